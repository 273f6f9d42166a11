//! The shape of OCI identifiers (OCIDs) nodekeeper accepts in its resources, written once: the
//! pattern the CRD schema checks and the parser the controller runs are kept equal by tests.
//!
//! An OCID is `ocid1.<resource type>.<realm>.[region][.future use].<unique id>`
//! (docs.oracle.com, "Resource Identifiers"); the region part is empty for resources that are not
//! regional, which gives the `..` seen in tenancy OCIDs.

/// Longest OCID accepted (OCI documents no smaller bound; real ones are about 90 characters).
pub const MAX_OCID_LEN: usize = 255;

/// The resource types whose OCIDs the resources name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OcidKind {
    Subnet,
    NetworkSecurityGroup,
    Instance,
    VnicAttachment,
    Vnic,
}

impl OcidKind {
    /// The resource-type part of the OCID.
    pub fn type_name(self) -> &'static str {
        match self {
            Self::Subnet => "subnet",
            Self::NetworkSecurityGroup => "networksecuritygroup",
            Self::Instance => "instance",
            Self::VnicAttachment => "vnicattachment",
            Self::Vnic => "vnic",
        }
    }

    /// Where a user finds an OCID of this kind, for error messages.
    fn where_to_find(self) -> &'static str {
        match self {
            Self::Subnet => {
                "copy it from the subnet's page in the console or `oci network subnet list`"
            }
            Self::NetworkSecurityGroup => {
                "copy it from the NSG's page in the console or `oci network nsg list`"
            }
            _ => "copy it from the console or the `oci` CLI",
        }
    }
}

/// Pattern (RE2 and OpenAPI compatible, without backslashes so that it can be embedded in a CEL
/// string literal unchanged) of subnet OCIDs; equal to [`check_ocid`] with [`OcidKind::Subnet`].
pub const SUBNET_OCID_PATTERN: &str =
    "^ocid1[.]subnet[.][a-z][a-z0-9]*[.][a-z0-9-]*([.][a-z0-9-]+)*[.][a-z0-9]+$";

/// Pattern of network security group OCIDs; equal to [`check_ocid`] with
/// [`OcidKind::NetworkSecurityGroup`].
pub const NSG_OCID_PATTERN: &str =
    "^ocid1[.]networksecuritygroup[.][a-z][a-z0-9]*[.][a-z0-9-]*([.][a-z0-9-]+)*[.][a-z0-9]+$";

/// Checks that `value` is an OCID of `kind`. The message says what is wrong and where to find a
/// correct one; the caller prefixes the field.
pub fn check_ocid(kind: OcidKind, value: &str) -> Result<(), String> {
    let expected = kind.type_name();
    let bad = |why: &str| {
        format!(
            "{value:?} is not a {expected} OCID ({why}); it must look like \
             ocid1.{expected}.oc1.<region>.<unique id>: {}",
            kind.where_to_find()
        )
    };
    if value.len() > MAX_OCID_LEN {
        return Err(bad(&format!("longer than {MAX_OCID_LEN} characters")));
    }
    let parts: Vec<&str> = value.split('.').collect();
    if parts.len() < 5 || parts[0] != "ocid1" {
        return Err(bad(
            "an OCID has at least five dot-separated parts, starting with ocid1",
        ));
    }
    if parts[1] != expected {
        return Err(bad(&format!("it names a {:?}", parts[1])));
    }
    let lower_alnum = |s: &str, dash: bool| {
        s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || (dash && b == b'-'))
    };
    let realm = parts[2];
    if !realm.starts_with(|c: char| c.is_ascii_lowercase()) || !lower_alnum(realm, false) {
        return Err(bad("the realm, such as oc1, is missing or malformed"));
    }
    let last = parts.len() - 1;
    // The region may be empty (non-regional resources); later middle parts may not.
    if !lower_alnum(parts[3], true)
        || parts[4..last]
            .iter()
            .any(|p| p.is_empty() || !lower_alnum(p, true))
    {
        return Err(bad("the region part is malformed"));
    }
    if parts[last].is_empty() || !lower_alnum(parts[last], false) {
        return Err(bad("the unique id must be lowercase letters and digits"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const SUBNET: &str =
        "ocid1.subnet.oc1.phx.aaaaaaaa5rqlj2kcofm4xz7hdp3ebtnwqgqnq6oqy7m3l3xcv2kx4wm7u3pa";

    #[test]
    fn accepts_regional_and_non_regional_forms() {
        assert_eq!(check_ocid(OcidKind::Subnet, SUBNET), Ok(()));
        assert_eq!(
            check_ocid(OcidKind::Subnet, "ocid1.subnet.oc1..aaaa1"),
            Ok(())
        );
        assert_eq!(
            check_ocid(
                OcidKind::Subnet,
                "ocid1.subnet.oc19.eu-frankfurt-2.future.aaa"
            ),
            Ok(())
        );
        assert_eq!(
            check_ocid(
                OcidKind::NetworkSecurityGroup,
                "ocid1.networksecuritygroup.oc1.iad.abc"
            ),
            Ok(())
        );
    }

    #[test]
    fn refuses_wrong_forms_saying_what_to_do() {
        for bad in [
            "",
            "subnet-1",
            "ocid1.vcn.oc1.phx.aaaa",
            "ocid2.subnet.oc1.phx.aaaa",
            "ocid1.subnet.oc1.phx.",
            "ocid1.subnet.OC1.phx.aaaa",
            "ocid1.subnet.oc1.phx.AAAA",
            "ocid1.subnet.oc1.phx..aaaa",
            "ocid1.subnet..phx.aaaa",
            "ocid1.subnet.oc1.phx",
            "ocid1.subnet.oc1.ph_x.aaaa",
        ] {
            let err = check_ocid(OcidKind::Subnet, bad).expect_err(bad);
            assert!(err.contains("ocid1.subnet.oc1.<region>"), "{err}");
            assert!(err.contains("oci network subnet list"), "{err}");
        }
        let long = format!("ocid1.subnet.oc1.phx.{}", "a".repeat(MAX_OCID_LEN));
        assert!(
            check_ocid(OcidKind::Subnet, &long)
                .unwrap_err()
                .contains("longer")
        );
        let err = check_ocid(OcidKind::Subnet, "ocid1.vcn.oc1.phx.aaaa").unwrap_err();
        assert!(err.contains("names a \"vcn\""), "{err}");
    }

    #[test]
    fn patterns_name_their_kind_and_contain_no_backslash() {
        // The patterns are embedded in CEL string literals, where a backslash would be an escape.
        for (kind, pattern) in [
            (OcidKind::Subnet, SUBNET_OCID_PATTERN),
            (OcidKind::NetworkSecurityGroup, NSG_OCID_PATTERN),
        ] {
            assert!(!pattern.contains('\\') && !pattern.contains('\''));
            assert!(pattern.starts_with(&format!("^ocid1[.]{}[.]", kind.type_name())));
        }
    }
}
