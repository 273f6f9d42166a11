//! Properties every generated CRD must have: group and version, status subresource, printer
//! columns, a description on every field (what `kubectl explain` shows), bounded status lists
//! (the write budget), and the defaults and CEL rules the types promise.

use nodekeeper_api::crd;
use nodekeeper_api::names;
use serde_json::Value;

fn crds() -> Vec<Value> {
    crd::all()
        .iter()
        .map(|c| serde_json::to_value(c).unwrap())
        .collect()
}

fn crd(plural: &str) -> Value {
    crds()
        .into_iter()
        .find(|c| c["spec"]["names"]["plural"] == plural)
        .unwrap_or_else(|| panic!("no CRD {plural}"))
}

fn schema(crd: &Value) -> &Value {
    &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
}

/// Every `x-kubernetes-validations` rule under `value`.
fn rules(value: &Value, out: &mut Vec<(String, String)>) {
    match value {
        Value::Object(map) => {
            if let Some(Value::Array(list)) = map.get("x-kubernetes-validations") {
                for r in list {
                    out.push((
                        r["rule"].as_str().unwrap().to_string(),
                        r["message"].as_str().unwrap_or_default().to_string(),
                    ));
                }
            }
            map.values().for_each(|v| rules(v, out));
        }
        Value::Array(items) => items.iter().for_each(|v| rules(v, out)),
        _ => {}
    }
}

#[test]
fn every_crd_is_in_our_group_with_status_and_columns() {
    let all = crds();
    assert_eq!(all.len(), 6);
    for c in &all {
        let name = c["metadata"]["name"].as_str().unwrap();
        assert_eq!(c["spec"]["group"], names::GROUP, "{name}");
        let versions = c["spec"]["versions"].as_array().unwrap();
        assert_eq!(versions.len(), 1, "{name}");
        assert_eq!(versions[0]["name"], names::VERSION, "{name}");
        assert_eq!(versions[0]["storage"], true, "{name}");
        assert!(
            versions[0]["subresources"]["status"].is_object(),
            "{name}: no status subresource"
        );
        let columns: Vec<&str> = versions[0]["additionalPrinterColumns"]
            .as_array()
            .unwrap_or_else(|| panic!("{name}: no printer columns"))
            .iter()
            .map(|c| c["name"].as_str().unwrap())
            .collect();
        assert_eq!(columns.last(), Some(&"Age"), "{name}");
        assert!(
            c["spec"]["names"]["categories"]
                .as_array()
                .unwrap()
                .contains(&Value::from("nodekeeper"))
        );
    }
    let scope = |p: &str| crd(p)["spec"]["scope"].as_str().unwrap().to_string();
    assert_eq!(scope("networktests"), "Namespaced");
    assert_eq!(scope("nodediagnostics"), "Namespaced");
    for p in [
        "nodenetworkconfigs",
        "nodemaintenances",
        "nodeclasses",
        "nodesets",
    ] {
        assert_eq!(scope(p), "Cluster", "{p}");
    }
}

#[test]
fn network_test_columns_are_the_promised_ones() {
    let c = crd("networktests");
    let columns: Vec<(&str, &str)> = c["spec"]["versions"][0]["additionalPrinterColumns"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| (c["name"].as_str().unwrap(), c["jsonPath"].as_str().unwrap()))
        .collect();
    assert_eq!(
        columns,
        [
            ("Kind", ".spec.kind"),
            ("Phase", ".status.phase"),
            ("Nodes", ".status.sources"),
            ("Success", ".status.successPercent"),
            ("P95us", ".status.latency.p95Us"),
            ("Age", ".metadata.creationTimestamp"),
        ]
    );
}

/// Every property below `spec` and `status` carries a description.
#[test]
fn every_field_is_documented() {
    fn walk(path: &str, schema: &Value, missing: &mut Vec<String>) {
        if let Some(Value::Object(props)) = schema.get("properties") {
            for (name, prop) in props {
                let p = format!("{path}.{name}");
                if prop
                    .get("description")
                    .and_then(Value::as_str)
                    .is_none_or(str::is_empty)
                {
                    missing.push(p.clone());
                }
                walk(&p, prop, missing);
            }
        }
        if let Some(items) = schema.get("items") {
            walk(&format!("{path}[]"), items, missing);
        }
        if let Some(extra) = schema.get("additionalProperties").filter(|v| v.is_object()) {
            walk(&format!("{path}{{}}"), extra, missing);
        }
    }
    let mut missing = Vec::new();
    for c in crds() {
        let kind = c["spec"]["names"]["kind"].as_str().unwrap().to_string();
        for part in ["spec", "status"] {
            let s = &schema(&c)["properties"][part];
            walk(&format!("{kind}.{part}"), s, &mut missing);
        }
    }
    assert!(
        missing.is_empty(),
        "fields without a description: {missing:#?}"
    );
}

/// Every list in a status has `maxItems`, so one status write stays small at any scale.
#[test]
fn status_lists_are_bounded() {
    fn walk(path: &str, schema: &Value, unbounded: &mut Vec<String>) {
        if schema.get("type") == Some(&Value::from("array")) && schema.get("maxItems").is_none() {
            unbounded.push(path.to_string());
        }
        if let Some(Value::Object(props)) = schema.get("properties") {
            for (name, prop) in props {
                walk(&format!("{path}.{name}"), prop, unbounded);
            }
        }
        if let Some(items) = schema.get("items") {
            walk(&format!("{path}[]"), items, unbounded);
        }
    }
    let mut unbounded = Vec::new();
    for c in crds() {
        let kind = c["spec"]["names"]["kind"].as_str().unwrap().to_string();
        walk(
            &format!("{kind}.status"),
            &schema(&c)["properties"]["status"],
            &mut unbounded,
        );
    }
    assert!(
        unbounded.is_empty(),
        "status lists without maxItems: {unbounded:?}"
    );
    let nt = crd("networktests");
    let status = &schema(&nt)["properties"]["status"]["properties"];
    assert_eq!(status["worstFailures"]["maxItems"], crd::MAX_LISTED as u64);
    assert_eq!(
        status["conditions"]["x-kubernetes-list-type"], "map",
        "conditions merge by type under server-side apply"
    );
}

#[test]
fn defaults_and_bounds_are_in_the_schema() {
    let nt = crd("networktests");
    let spec = &schema(&nt)["properties"]["spec"]["properties"];
    assert_eq!(spec["count"]["default"], 3);
    assert_eq!(spec["count"]["minimum"], 1.0);
    assert_eq!(spec["count"]["maximum"], 100.0);
    assert_eq!(spec["maxNodes"]["default"], 100);
    assert_eq!(spec["ttlSecondsAfterFinished"]["default"], 3600);
    assert_eq!(spec["targets"]["maxItems"], 1000);
    assert_eq!(
        spec["targets"]["items"]["properties"]["peers"]["properties"]["perNode"]["maximum"],
        16.0
    );

    let nm = crd("nodemaintenances");
    let spec = &schema(&nm)["properties"]["spec"]["properties"];
    assert_eq!(spec["stage"]["default"], "Idle");
    assert_eq!(spec["onTimeout"]["default"], "Fail");
    assert_eq!(spec["drainTimeout"]["default"], "1h");
    assert!(spec["drainTimeout"]["pattern"].is_string());

    let ns = crd("nodesets");
    let spec = &schema(&ns)["properties"]["spec"]["properties"];
    assert_eq!(spec["maxSurge"]["x-kubernetes-int-or-string"], true);
    assert_eq!(spec["maxSurge"]["nullable"], false);
    assert_eq!(spec["maxSurge"]["default"], 1);
    let scale = &ns["spec"]["versions"][0]["subresources"]["scale"];
    assert_eq!(scale["specReplicasPath"], ".spec.replicas");
    assert_eq!(scale["statusReplicasPath"], ".status.replicas");

    // Only formats the API server knows are left (schemars' uint32 and friends are removed).
    let text = serde_json::to_string(&crds()).unwrap();
    assert!(
        !text.contains("\"format\":\"uint"),
        "unknown integer formats left in the CRDs"
    );
}

#[test]
fn cel_rules_are_present_and_explain_themselves() {
    let expected = [
        ("networktests", "self == oldSelf"),
        ("networktests", "exists_one(x, x)"),
        ("networktests", "isURL(self)"),
        ("networktests", "isIP(self)"),
        (
            "networktests",
            "self.kind != 'dns' || self.targets.all(t, has(t.hostname))",
        ),
        (
            "nodenetworkconfigs",
            "has(self.ociVnics) || has(self.state)",
        ),
        ("nodenetworkconfigs", "type(self) == int ? self >= 0"),
        (
            "nodemaintenances",
            "oldSelf.stage == 'Idle' || self.nodeSelector == oldSelf.nodeSelector",
        ),
        (
            "nodemaintenances",
            "has(self.matchLabels) && size(self.matchLabels) > 0",
        ),
        ("nodeclasses", "self.provider == 'oci' ? has(self.oci)"),
        ("nodesets", "string(self.maxSurge) in ['0', '0%']"),
    ];
    for (plural, fragment) in expected {
        let mut found = Vec::new();
        rules(schema(&crd(plural)), &mut found);
        assert!(
            found.iter().any(|(rule, _)| rule.contains(fragment)),
            "{plural}: no rule containing {fragment:?}; rules: {found:#?}"
        );
    }
    for c in crds() {
        let mut found = Vec::new();
        rules(schema(&c), &mut found);
        for (rule, message) in found {
            assert!(
                message.len() > 20,
                "{}: rule {rule:?} needs a message naming the field and the fix",
                c["metadata"]["name"]
            );
        }
    }
}
