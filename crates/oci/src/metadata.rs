//! The instance metadata answers nodekeeper uses (`/opc/v2/vnics/`, `/opc/v2/instance/`), parsed
//! defensively: every field is checked, and a problem is reported with its path, e.g.
//! `vnics[1].subnetCidrBlock: expected a CIDR, got "<null>"`.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::{Ipv4Net, Ipv6Net};
use nodekeeper_model::network::{format_mac, parse_mac};
use serde_json::{Map, Value};

/// One VNIC as `/opc/v2/vnics/` describes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Vnic {
    pub vnic_id: String,
    /// Lower-case colon form.
    pub mac_addr: String,
    pub vlan_tag: u16,
    /// Bare metal only: which physical NIC the VNIC lives on.
    pub nic_index: Option<u32>,
    /// IPv4 part; `None` for an IPv6-only VNIC.
    pub ipv4: Option<VnicIpv4>,
    /// IPv6 part; `None` when the VNIC has no IPv6 address.
    pub ipv6: Option<VnicIpv6>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VnicIpv4 {
    pub private_ip: Ipv4Addr,
    pub subnet: Ipv4Net,
    pub virtual_router_ip: Ipv4Addr,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VnicIpv6 {
    pub addresses: Vec<Ipv6Addr>,
    pub subnet: Ipv6Net,
    pub virtual_router_ip: Ipv6Addr,
}

/// The part of `/opc/v2/instance/` nodekeeper uses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Instance {
    pub id: String,
    pub shape: String,
    pub region: String,
}

impl Instance {
    /// Bare-metal shapes start with `BM.`.
    pub fn is_bare_metal(&self) -> bool {
        self.shape.starts_with("BM.")
    }
}

/// A malformed metadata answer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{path}: {message}")]
pub struct ParseError {
    pub path: String,
    pub message: String,
}

fn perr(path: impl Into<String>, message: impl Into<String>) -> ParseError {
    ParseError {
        path: path.into(),
        message: message.into(),
    }
}

/// Values OCI has been seen to send where a field is simply absent.
fn is_absent(v: Option<&Value>) -> bool {
    match v {
        None | Some(Value::Null) => true,
        Some(Value::String(s)) => s.is_empty() || s == "<null>",
        _ => false,
    }
}

fn shown(v: &Value) -> String {
    nodekeeper_model::text::truncate(&v.to_string(), 80).into_owned()
}

fn req_str<'a>(o: &'a Map<String, Value>, path: &str, key: &str) -> Result<&'a str, ParseError> {
    match o.get(key) {
        Some(Value::String(s)) if !s.is_empty() => Ok(s),
        None => Err(perr(format!("{path}.{key}"), "missing")),
        Some(v) => Err(perr(
            format!("{path}.{key}"),
            format!("expected a non-empty string, got {}", shown(v)),
        )),
    }
}

fn parse_field<T: std::str::FromStr>(
    o: &Map<String, Value>,
    path: &str,
    key: &str,
    what: &str,
) -> Result<Option<T>, ParseError> {
    let v = o.get(key);
    if is_absent(v) {
        return Ok(None);
    }
    match v {
        Some(Value::String(s)) => s.parse().map(Some).map_err(|_| {
            perr(
                format!("{path}.{key}"),
                format!("expected {what}, got {}", shown(&Value::String(s.clone()))),
            )
        }),
        Some(v) => Err(perr(
            format!("{path}.{key}"),
            format!("expected {what}, got {}", shown(v)),
        )),
        None => Ok(None),
    }
}

/// Like [`parse_field`] but the field must be there, and `"<null>"` is reported as such.
fn need_field<T: std::str::FromStr>(
    o: &Map<String, Value>,
    path: &str,
    key: &str,
    what: &str,
    because: &str,
) -> Result<T, ParseError> {
    match parse_field(o, path, key, what)? {
        Some(v) => Ok(v),
        None => Err(perr(
            format!("{path}.{key}"),
            match o.get(key) {
                Some(v) => format!("expected {what}, got {} ({because})", shown(v)),
                None => format!("missing ({because})"),
            },
        )),
    }
}

fn opt_uint(
    o: &Map<String, Value>,
    path: &str,
    key: &str,
    max: u64,
) -> Result<Option<u64>, ParseError> {
    match o.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => match n.as_u64() {
            Some(x) if x <= max => Ok(Some(x)),
            _ => Err(perr(
                format!("{path}.{key}"),
                format!("expected an integer 0–{max}, got {n}"),
            )),
        },
        Some(v) => Err(perr(
            format!("{path}.{key}"),
            format!("expected an integer, got {}", shown(v)),
        )),
    }
}

/// Parses the `/opc/v2/vnics/` answer (primary VNIC first).
pub fn parse_vnics(body: &str) -> Result<Vec<Vnic>, ParseError> {
    let v: Value =
        serde_json::from_str(body).map_err(|e| perr("vnics", format!("not JSON: {e}")))?;
    let Value::Array(items) = v else {
        return Err(perr(
            "vnics",
            format!("expected an array, got {}", shown(&v)),
        ));
    };
    if items.is_empty() {
        return Err(perr("vnics", "empty: every instance has a primary VNIC"));
    }
    items
        .iter()
        .enumerate()
        .map(|(i, item)| parse_vnic(i, item))
        .collect()
}

fn parse_vnic(i: usize, item: &Value) -> Result<Vnic, ParseError> {
    let path = format!("vnics[{i}]");
    let Value::Object(o) = item else {
        return Err(perr(
            path,
            format!("expected an object, got {}", shown(item)),
        ));
    };
    let vnic_id = req_str(o, &path, "vnicId")?.to_string();
    let mac = req_str(o, &path, "macAddr")?;
    let mac_addr = parse_mac(mac).map(|m| format_mac(&m)).ok_or_else(|| {
        perr(
            format!("{path}.macAddr"),
            format!("expected a MAC like 02:00:17:0a:22:02, got {mac:?}"),
        )
    })?;
    let vlan_tag = opt_uint(o, &path, "vlanTag", 4094)?
        .ok_or_else(|| perr(format!("{path}.vlanTag"), "missing"))? as u16;
    let nic_index = opt_uint(o, &path, "nicIndex", u64::from(u32::MAX))?.map(|x| x as u32);

    let ipv4 = match parse_field::<Ipv4Addr>(o, &path, "privateIp", "an IPv4 address")? {
        None => None,
        Some(private_ip) => {
            let because = "the VNIC has an IPv4 privateIp";
            let subnet: Ipv4Net = need_field(o, &path, "subnetCidrBlock", "a CIDR", because)?;
            if !subnet.contains(&private_ip) {
                return Err(perr(
                    format!("{path}.subnetCidrBlock"),
                    format!("{subnet} does not contain privateIp {private_ip}"),
                ));
            }
            let virtual_router_ip =
                need_field(o, &path, "virtualRouterIp", "an IPv4 address", because)?;
            Some(VnicIpv4 {
                private_ip,
                subnet,
                virtual_router_ip,
            })
        }
    };
    let addresses: Vec<Ipv6Addr> = match o.get("ipv6Addresses") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(a)) => a
            .iter()
            .enumerate()
            .map(|(j, x)| match x {
                Value::String(s) => s.parse().map_err(|_| {
                    perr(
                        format!("{path}.ipv6Addresses[{j}]"),
                        format!("expected an IPv6 address, got {s:?}"),
                    )
                }),
                v => Err(perr(
                    format!("{path}.ipv6Addresses[{j}]"),
                    format!("expected a string, got {}", shown(v)),
                )),
            })
            .collect::<Result<_, _>>()?,
        Some(v) => {
            return Err(perr(
                format!("{path}.ipv6Addresses"),
                format!("expected an array, got {}", shown(v)),
            ));
        }
    };
    let ipv6 = if addresses.is_empty() {
        None
    } else {
        let because = "the VNIC has ipv6Addresses";
        let subnet: Ipv6Net = need_field(o, &path, "ipv6SubnetCidrBlock", "an IPv6 CIDR", because)?;
        if let Some(a) = addresses.iter().find(|a| !subnet.contains(*a)) {
            return Err(perr(
                format!("{path}.ipv6Addresses"),
                format!("{a} is not in ipv6SubnetCidrBlock {subnet}"),
            ));
        }
        let virtual_router_ip =
            need_field(o, &path, "ipv6VirtualRouterIp", "an IPv6 address", because)?;
        Some(VnicIpv6 {
            addresses,
            subnet,
            virtual_router_ip,
        })
    };
    if ipv4.is_none() && ipv6.is_none() {
        return Err(perr(path, "has neither privateIp nor ipv6Addresses"));
    }
    Ok(Vnic {
        vnic_id,
        mac_addr,
        vlan_tag,
        nic_index,
        ipv4,
        ipv6,
    })
}

/// Parses the `/opc/v2/instance/` answer.
pub fn parse_instance(body: &str) -> Result<Instance, ParseError> {
    let v: Value =
        serde_json::from_str(body).map_err(|e| perr("instance", format!("not JSON: {e}")))?;
    let Value::Object(o) = &v else {
        return Err(perr(
            "instance",
            format!("expected an object, got {}", shown(&v)),
        ));
    };
    Ok(Instance {
        id: req_str(o, "instance", "id")?.to_string(),
        shape: req_str(o, "instance", "shape")?.to_string(),
        region: o
            .get("region")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string(),
    })
}

/// The IP of a VNIC's IPv4 part, for messages.
pub fn vnic_ip(v: &Vnic) -> Option<IpAddr> {
    v.ipv4
        .as_ref()
        .map(|x| IpAddr::V4(x.private_ip))
        .or_else(|| {
            v.ipv6
                .as_ref()
                .and_then(|x| x.addresses.first().map(|a| IpAddr::V6(*a)))
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use pretty_assertions::assert_eq;

    const VM: &str = include_str!("../tests/fixtures/vnics-vm.json");
    const BM: &str = include_str!("../tests/fixtures/vnics-bm.json");

    #[test]
    fn samples_parse() {
        let vm = parse_vnics(VM).unwrap();
        assert_eq!(vm.len(), 3);
        assert_eq!(
            vm[2].ipv6.as_ref().unwrap().addresses,
            vec!["fd00:10:30::45".parse::<Ipv6Addr>().unwrap()]
        );
        assert_eq!(vm[1].nic_index, None);
        let bm = parse_vnics(BM).unwrap();
        assert_eq!((bm[2].vlan_tag, bm[2].nic_index), (37, Some(1)));
        let inst = parse_instance(include_str!("../tests/fixtures/instance-bm.json")).unwrap();
        assert!(inst.is_bare_metal());
    }

    #[test]
    fn null_subnet_is_an_error_only_when_ipv4_is_used() {
        let body = r#"[{"vnicId":"a","macAddr":"02:00:17:00:00:01","vlanTag":0,"privateIp":"10.0.0.2",
            "virtualRouterIp":"10.0.0.1","subnetCidrBlock":"10.0.0.0/24"},
            {"vnicId":"b","macAddr":"02:00:17:00:00:02","vlanTag":5,"privateIp":"10.0.1.2",
            "virtualRouterIp":"10.0.1.1","subnetCidrBlock":"<null>"}]"#;
        assert_eq!(
            parse_vnics(body).unwrap_err().to_string(),
            "vnics[1].subnetCidrBlock: expected a CIDR, got \"<null>\" (the VNIC has an IPv4 privateIp)"
        );
        let v6only =
            parse_vnics(include_str!("../tests/fixtures/vnics-vm-ipv6-only.json")).unwrap();
        assert!(v6only[1].ipv4.is_none());
        assert_eq!(
            v6only[1].ipv6.as_ref().unwrap().subnet.to_string(),
            "fd00:10:40::/64"
        );
    }

    #[test]
    fn garbage_is_named() {
        let cases = [
            ("<html>oops</html>", "vnics: not JSON"),
            ("{}", "vnics: expected an array, got {}"),
            ("[]", "vnics: empty"),
            (
                r#"[{"vnicId":"a","macAddr":"zz","vlanTag":0,"privateIp":"10.0.0.2"}]"#,
                "vnics[0].macAddr: expected a MAC",
            ),
            (
                r#"[{"vnicId":"a","macAddr":"02:00:17:00:00:01","vlanTag":5000}]"#,
                "vnics[0].vlanTag: expected an integer 0–4094",
            ),
            (
                r#"[{"vnicId":"a","macAddr":"02:00:17:00:00:01","vlanTag":1}]"#,
                "vnics[0]: has neither privateIp nor ipv6Addresses",
            ),
            (
                r#"[{"vnicId":"a","macAddr":"02:00:17:00:00:01","vlanTag":1,"privateIp":"10.9.0.2","subnetCidrBlock":"10.0.0.0/24","virtualRouterIp":"10.0.0.1"}]"#,
                "vnics[0].subnetCidrBlock: 10.0.0.0/24 does not contain privateIp 10.9.0.2",
            ),
            (
                r#"[{"macAddr":"02:00:17:00:00:01"}]"#,
                "vnics[0].vnicId: missing",
            ),
        ];
        for (body, want) in cases {
            let e = parse_vnics(body).unwrap_err().to_string();
            assert!(e.starts_with(want), "{body}: got {e:?}, want {want:?}");
        }
        assert_eq!(
            parse_instance(r#"{"id":"x"}"#).unwrap_err().to_string(),
            "instance.shape: missing"
        );
    }

    #[test]
    fn multibyte_text_in_a_field_is_reported_not_a_panic() {
        // A long non-ASCII value where an address belongs: the error quotes it shortened, and the
        // cut falls inside a multibyte character for every length class (this panicked before).
        for pad in 0..4 {
            let value = format!("{}{}", "a".repeat(pad), "日本語".repeat(40));
            let doc = serde_json::json!([{
                "vnicId": "ocid1.vnic.oc1..x", "privateIp": value, "vlanTag": 0,
                "macAddr": "02:00:17:00:00:01", "virtualRouterIp": "10.0.0.1",
                "subnetCidrBlock": "10.0.0.0/24"
            }]);
            let error = parse_vnics(&doc.to_string()).unwrap_err().to_string();
            assert!(error.contains("privateIp"), "{error}");
            assert!(error.contains('…'), "{error}");
        }
    }
}
