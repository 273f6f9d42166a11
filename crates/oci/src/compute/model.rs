//! The Compute API (20160918) documents nodekeeper reads and writes: VNIC attachments, VNICs and
//! instances, in the JSON shape the service uses (camelCase). Fields nodekeeper does not use are
//! left out; unknown fields and unknown enum values are tolerated so a service that adds one does
//! not break the client. Facts: `shared/oci/compute-api.md` §3.

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

/// `VnicAttachment.lifecycleState`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum VnicAttachmentState {
    Attaching,
    Attached,
    Detaching,
    Detached,
    #[serde(other)]
    Unknown,
}

impl VnicAttachmentState {
    /// DETACHING or DETACHED: the attachment is gone or going (an attach that failed goes
    /// ATTACHING → DETACHING).
    pub fn is_gone(self) -> bool {
        matches!(self, Self::Detaching | Self::Detached)
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct VnicAttachment {
    pub id: String,
    pub instance_id: String,
    pub lifecycle_state: VnicAttachmentState,
    /// Present once the attach completes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vnic_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nic_index: Option<u32>,
    /// Present once the attach completes; meaningful on bare metal only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vlan_tag: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub subnet_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub display_name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub availability_domain: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compartment_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub time_created: Option<String>,
}

/// `CreateVnicDetails` (inside AttachVnic and LaunchInstance).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CreateVnicDetails {
    pub subnet_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub assign_public_ip: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub skip_source_dest_check: Option<bool>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub nsg_ids: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub display_name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hostname_label: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub private_ip: Option<String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub freeform_tags: BTreeMap<String, String>,
}

/// `AttachVnicDetails`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AttachVnicDetails {
    pub instance_id: String,
    pub create_vnic_details: CreateVnicDetails,
    /// Physical NIC on two-NIC bare-metal shapes (0 or 1); leave unset on VMs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nic_index: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub display_name: Option<String>,
}

/// `Vnic.lifecycleState`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum VnicState {
    Provisioning,
    Available,
    Terminating,
    Terminated,
    #[serde(other)]
    Unknown,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Vnic {
    pub id: String,
    pub lifecycle_state: VnicState,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub private_ip: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mac_address: Option<String>,
    #[serde(default)]
    pub is_primary: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub subnet_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hostname_label: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub public_ip: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub nsg_ids: Vec<String>,
    #[serde(default)]
    pub skip_source_dest_check: bool,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ipv6_addresses: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub display_name: Option<String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub freeform_tags: BTreeMap<String, String>,
}

/// `Instance.lifecycleState`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum InstanceState {
    Moving,
    Provisioning,
    Running,
    Starting,
    Stopping,
    Stopped,
    CreatingImage,
    Terminating,
    Terminated,
    #[serde(other)]
    Unknown,
}

impl InstanceState {
    /// TERMINATING or TERMINATED: such instances stay listed for hours and must be filtered.
    pub fn is_terminal(self) -> bool {
        matches!(self, Self::Terminating | Self::Terminated)
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Instance {
    pub id: String,
    pub lifecycle_state: InstanceState,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub display_name: Option<String>,
    #[serde(default)]
    pub shape: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub availability_domain: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compartment_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fault_domain: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub region: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub time_created: Option<String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub freeform_tags: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub metadata: BTreeMap<String, String>,
}

impl Instance {
    /// When the instance was created, from `timeCreated` (`None` when absent or unreadable).
    pub fn created(&self) -> Option<SystemTime> {
        self.time_created.as_deref().and_then(parse_time)
    }
}

/// A time as the Compute API writes it: RFC 3339 (`2016-08-25T21:10:29.600Z`, or with an offset
/// such as `+02:00`). An HTTP date (`Tue, 25 Aug 2016 21:10:29 GMT`, what OCI's headers carry)
/// is read too, so a service or stand-in that writes that form is not misread as "no time".
pub fn parse_time(s: &str) -> Option<SystemTime> {
    parse_rfc3339(s.trim()).or_else(|| httpdate::parse_http_date(s.trim()).ok())
}

/// RFC 3339's `date-time`: `YYYY-MM-DDTHH:MM:SS[.fraction](Z|±HH:MM)`, `t` and `z` accepted.
fn parse_rfc3339(s: &str) -> Option<SystemTime> {
    let b = s.as_bytes();
    let num = |from: usize, len: usize| -> Option<i64> {
        let digits = b.get(from..from + len)?;
        digits
            .iter()
            .all(u8::is_ascii_digit)
            .then(|| std::str::from_utf8(digits).ok()?.parse().ok())?
    };
    if b.len() < 20
        || b[4] != b'-'
        || b[7] != b'-'
        || !matches!(b[10], b'T' | b't' | b' ')
        || b[13] != b':'
        || b[16] != b':'
    {
        return None;
    }
    let (year, month, day) = (num(0, 4)?, num(5, 2)?, num(8, 2)?);
    let (hour, minute, second) = (num(11, 2)?, num(14, 2)?, num(17, 2)?);
    if !(1..=12).contains(&month) || !(1..=31).contains(&day) || hour > 23 || minute > 59 {
        return None;
    }
    // A leap second reads as the second before the next minute's start.
    let second = second.min(59);
    let mut at = 19;
    let mut nanos: u32 = 0;
    if b.get(at) == Some(&b'.') {
        at += 1;
        let start = at;
        while b.get(at).is_some_and(u8::is_ascii_digit) {
            at += 1;
        }
        if at == start {
            return None;
        }
        // Nanosecond precision; further digits are dropped.
        let digits = &s[start..at.min(start + 9)];
        nanos = format!("{digits:0<9}").parse().ok()?;
    }
    let offset = match b.get(at)? {
        b'Z' | b'z' if at + 1 == b.len() => 0,
        sign @ (b'+' | b'-') if at + 6 == b.len() && b[at + 3] == b':' => {
            let (h, m) = (num(at + 1, 2)?, num(at + 4, 2)?);
            if h > 23 || m > 59 {
                return None;
            }
            let minutes = h * 60 + m;
            if *sign == b'+' { minutes } else { -minutes }
        }
        _ => return None,
    };
    let days = days_from_civil(year, month, day);
    let unix = days * 86_400 + hour * 3_600 + minute * 60 + second - offset * 60;
    let unix = u64::try_from(unix).ok()?;
    Some(UNIX_EPOCH + Duration::new(unix, nanos))
}

/// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's `days_from_civil`).
fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// `LaunchInstanceShapeConfigDetails`, for Flex shapes.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ShapeConfig {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ocpus: Option<f32>,
    /// OCI spells it `memoryInGBs`, which camelCase renaming would not produce.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        rename = "memoryInGBs"
    )]
    pub memory_in_gbs: Option<f32>,
}

/// `InstanceSourceDetails`: an image or a boot volume.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "sourceType", rename_all = "camelCase")]
pub enum SourceDetails {
    #[serde(rename = "image", rename_all = "camelCase")]
    Image {
        image_id: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        boot_volume_size_in_gbs: Option<u64>,
    },
    #[serde(rename = "bootVolume", rename_all = "camelCase")]
    BootVolume { boot_volume_id: String },
}

/// `LaunchInstanceDetails`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LaunchInstanceDetails {
    pub availability_domain: String,
    pub compartment_id: String,
    pub shape: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shape_config: Option<ShapeConfig>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_details: Option<SourceDetails>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub create_vnic_details: Option<CreateVnicDetails>,
    /// `ssh_authorized_keys`, `user_data` (base64 cloud-init), …
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub metadata: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub display_name: Option<String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub freeform_tags: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fault_domain: Option<String>,
}

/// A `Shape` as ListShapes reports it (the fields nodekeeper reads).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Shape {
    pub shape: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub is_flexible: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_vnic_attachments: Option<u32>,
}

/// Filters of ListInstances beyond the compartment.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ListInstancesFilter {
    pub availability_domain: Option<String>,
    pub display_name: Option<String>,
    pub lifecycle_state: Option<InstanceState>,
}

/// Options of TerminateInstance.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TerminateOptions {
    pub preserve_boot_volume: bool,
    /// Act only if the instance's etag still matches.
    pub if_match: Option<String>,
}

/// OCI's error document.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ErrorBody {
    #[serde(default)]
    pub code: String,
    #[serde(default)]
    pub message: String,
}

#[cfg(test)]
mod tests {

    #[test]
    fn times_are_read_as_the_service_writes_them() {
        let at = |secs: u64, nanos: u32| Some(UNIX_EPOCH + Duration::new(secs, nanos));
        assert_eq!(parse_time("1970-01-01T00:00:00Z"), at(0, 0));
        assert_eq!(
            parse_time("2016-08-25T21:10:29.600Z"),
            at(1_472_159_429, 600_000_000)
        );
        assert_eq!(
            parse_time("2016-08-25T23:10:29+02:00"),
            at(1_472_159_429, 0)
        );
        assert_eq!(
            parse_time("2016-08-25T20:10:29-01:00"),
            at(1_472_159_429, 0)
        );
        assert_eq!(
            parse_time("2024-02-29T12:00:00.123456789123Z"),
            at(1_709_208_000, 123_456_789)
        );
        assert_eq!(
            parse_time("Thu, 25 Aug 2016 21:10:29 GMT"),
            at(1_472_159_429, 0)
        );
        for bad in [
            "",
            "2016-08-25",
            "2016-08-25T21:10:29",
            "2016-13-25T21:10:29Z",
            "2016-08-25T21:10:29.Z",
            "yesterday",
        ] {
            assert_eq!(parse_time(bad), None, "{bad:?}");
        }
        let i: Instance = serde_json::from_str(
            r#"{"id":"i","lifecycleState":"RUNNING","timeCreated":"2016-08-25T21:10:29.600Z"}"#,
        )
        .unwrap();
        assert_eq!(i.created(), at(1_472_159_429, 600_000_000));
    }
    use super::*;

    #[test]
    fn attachment_parses_before_and_after_attach_and_tolerates_new_states() {
        let a: VnicAttachment = serde_json::from_str(
            r#"{"id":"a","instanceId":"i","lifecycleState":"ATTACHING","displayName":"x","timeCreated":"2026-01-01T00:00:00Z","extra":1}"#,
        )
        .unwrap();
        assert_eq!(a.lifecycle_state, VnicAttachmentState::Attaching);
        assert_eq!(a.vnic_id, None);
        let b: VnicAttachment = serde_json::from_str(
            r#"{"id":"a","instanceId":"i","lifecycleState":"SOMETHING_NEW","vnicId":"v","vlanTag":12}"#,
        )
        .unwrap();
        assert_eq!(b.lifecycle_state, VnicAttachmentState::Unknown);
        assert_eq!(b.vlan_tag, Some(12));
    }

    #[test]
    fn attach_details_serialise_as_the_api_names_them() {
        let d = AttachVnicDetails {
            instance_id: "i".into(),
            create_vnic_details: CreateVnicDetails {
                subnet_id: "s".into(),
                skip_source_dest_check: Some(true),
                nsg_ids: vec!["n".into()],
                ..Default::default()
            },
            nic_index: Some(1),
            display_name: Some("d".into()),
        };
        assert_eq!(
            serde_json::to_value(&d).unwrap(),
            serde_json::json!({"instanceId":"i","createVnicDetails":{"subnetId":"s","skipSourceDestCheck":true,"nsgIds":["n"]},"nicIndex":1,"displayName":"d"})
        );
    }

    #[test]
    fn launch_details_tag_the_source_type() {
        let d = LaunchInstanceDetails {
            availability_domain: "AD-1".into(),
            compartment_id: "c".into(),
            shape: "VM.Standard.E5.Flex".into(),
            shape_config: Some(ShapeConfig {
                ocpus: Some(2.0),
                memory_in_gbs: None,
            }),
            source_details: Some(SourceDetails::Image {
                image_id: "img".into(),
                boot_volume_size_in_gbs: None,
            }),
            create_vnic_details: None,
            metadata: BTreeMap::new(),
            display_name: None,
            freeform_tags: BTreeMap::new(),
            fault_domain: None,
        };
        let v = serde_json::to_value(&d).unwrap();
        assert_eq!(
            v["sourceDetails"],
            serde_json::json!({"sourceType":"image","imageId":"img"})
        );
        assert_eq!(v["shapeConfig"], serde_json::json!({"ocpus":2.0}));
        let flex = ShapeConfig {
            ocpus: Some(2.0),
            memory_in_gbs: Some(16.0),
        };
        assert_eq!(
            serde_json::to_value(&flex).unwrap(),
            serde_json::json!({"ocpus":2.0,"memoryInGBs":16.0})
        );
    }
}
