//! The Helm chart `deploy/helm/nodekeeper` against the kustomize base: with default values it
//! renders exactly the objects `kubectl apply -k deploy/` and the example tuning ConfigMap
//! install, so the two install paths cannot drift; `helm lint` passes; the values schema refuses
//! unknown keys and wrong types naming them; and each documented value reaches the object it
//! is for. Helm is the pinned one (`xtask/tools/helm`), kustomize the control plane's kubectl.
//! No cluster is needed: installing into another namespace is in `install_rbac.rs`.
//!
//! Run: `cargo test -p nodekeeper-e2e --test install_chart`.

mod install_common;

use std::collections::BTreeMap;

use install_common::{by_key, chart_dir, documents, helm, helm_template, kustomize, repo, run};
use serde_json::{Value, json};

/// `helm lint --strict` of the chart with its default values, and with every switch flipped.
#[test]
fn chart_lints() {
    let chart = chart_dir();
    let chart = chart.to_str().unwrap();
    let out = run(&helm(), &["lint", "--strict", chart]).unwrap_or_else(|e| panic!("{e}"));
    assert!(out.contains("0 chart(s) failed"), "{out}");
    let flipped = [
        "--set=features.repair=true,createNamespace=true,agent.privileged=true",
        "--set=agent.hostMounts.kmsg=false,agent.hostMounts.journal=false,tuning.create=false",
        "--set=agent.metrics.enabled=false,monitoring.podMonitor.enabled=true",
        "--set=ociCredentials.existingSecret=oci-api-key,images.agent.digest=sha256:0000000000000000000000000000000000000000000000000000000000000000",
    ];
    for set in flipped {
        run(&helm(), &["lint", "--strict", chart, set]).unwrap_or_else(|e| panic!("{set}: {e}"));
    }
}

/// What `kubectl apply -k deploy/` and `kubectl apply -f deploy/examples/tuning-configmap.yaml`
/// install, by key, without the Namespace (Helm installs into `--namespace`; the chart creates
/// it only with `createNamespace`).
fn kustomize_install() -> BTreeMap<String, Value> {
    let mut objects = kustomize(&repo().join("deploy")).expect("kubectl kustomize deploy/");
    let tuning = std::fs::read_to_string(repo().join("deploy/examples/tuning-configmap.yaml"))
        .expect("read the example tuning ConfigMap");
    objects.extend(documents(&tuning).unwrap());
    objects.retain(|o| o["kind"] != "Namespace");
    by_key(objects)
}

#[test]
fn default_values_render_the_kustomize_base() {
    let base = kustomize_install();
    let chart = by_key(helm_template("nodekeeper", &[]).unwrap_or_else(|e| panic!("{e}")));
    let only_base: Vec<&String> = base.keys().filter(|k| !chart.contains_key(*k)).collect();
    let only_chart: Vec<&String> = chart.keys().filter(|k| !base.contains_key(*k)).collect();
    assert!(
        only_base.is_empty() && only_chart.is_empty(),
        "objects only in deploy/: {only_base:?}; only in the chart: {only_chart:?}"
    );
    for (key, expected) in &base {
        let rendered = &chart[key];
        assert!(
            rendered == expected,
            "{key} differs between deploy/ and the chart's defaults:\n--- deploy/\n{}\n--- chart\n{}",
            serde_yaml::to_string(expected).unwrap(),
            serde_yaml::to_string(rendered).unwrap()
        );
    }
    // The test must compare something: the controller, its RBAC, the agent, the tuning.
    for key in [
        "Deployment/nodekeeper/nodekeeper-controller",
        "ClusterRole//nodekeeper-controller",
        "DaemonSet/nodekeeper/nodekeeper-agent",
        "ConfigMap/nodekeeper/nodekeeper-tuning",
    ] {
        assert!(base.contains_key(key), "{key} missing from deploy/");
    }
}

/// `cargo xtask demo` names the file each installed object comes from: every object
/// `kubectl kustomize deploy/` renders has one, and it is the file that holds that object.
#[test]
fn every_rendered_object_has_its_file() {
    let deploy = repo().join("deploy");
    let rendered = kustomize(&deploy).expect("kubectl kustomize deploy/");
    let origins = nodekeeper_e2e::install::origins(&deploy, &repo()).expect("read deploy/'s files");
    assert!(
        rendered.len() >= 8,
        "deploy/ rendered only {} objects",
        rendered.len()
    );
    for object in &rendered {
        let key = install_common::key(object);
        let file = origins
            .get(&key)
            .unwrap_or_else(|| panic!("{key}: no file under deploy/ holds it ({origins:?})"));
        let text = std::fs::read_to_string(repo().join(file)).unwrap();
        let found = documents(&text)
            .unwrap()
            .iter()
            .any(|o| install_common::key(o) == key);
        assert!(found, "{key} is not in {}", file.display());
    }
}

/// The chart's `crds/` is `deploy/crds/` (a link), so `helm install` installs the generated CRDs.
#[test]
fn chart_crds_are_the_generated_ones() {
    let rendered =
        by_key(helm_template("nodekeeper", &["--include-crds"]).unwrap_or_else(|e| panic!("{e}")));
    let mut generated = 0;
    for entry in std::fs::read_dir(repo().join("deploy/crds")).unwrap() {
        let path = entry.unwrap().path();
        for crd in documents(&std::fs::read_to_string(&path).unwrap()).unwrap() {
            let key = install_common::key(&crd);
            assert_eq!(
                rendered.get(&key),
                Some(&crd),
                "{key} from {}",
                path.display()
            );
            generated += 1;
        }
    }
    assert!(generated >= 5, "only {generated} CRDs in deploy/crds");
}

/// Renders with `args` and expects Helm to refuse, returning its message.
fn refused(args: &[&str]) -> String {
    match helm_template("nodekeeper", args) {
        Ok(_) => panic!("helm template {args:?} was accepted"),
        Err(message) => message,
    }
}

#[test]
fn schema_refuses_unknown_keys_and_wrong_types() {
    // (arguments, what the message must name)
    let cases: [(&[&str], &[&str]); 10] = [
        (&["--set", "controler.replicas=1"], &["controler"]),
        (&["--set", "agent.tolerance=x"], &["agent", "tolerance"]),
        (
            &["--set-string", "agent.port=9443"],
            &["agent", "port", "integer"],
        ),
        (
            &["--set", "features.repair=maybe"],
            &["features", "repair", "boolean"],
        ),
        (
            &["--set", "images.agent.pullPolicy=Sometimes"],
            &["pullPolicy"],
        ),
        (&["--set", "controller.replicas=0"], &["replicas"]),
        (&["--set", "images.controller.digest=latest"], &["digest"]),
        (
            &["--set-string", "agent.metrics.port=9444"],
            &["metrics", "port", "integer"],
        ),
        (&["--set", "agent.metrics.prot=9444"], &["metrics", "prot"]),
        // The metrics listener on the gRPC port would fail to bind: refused before it ships.
        (
            &["--set", "agent.metrics.port=9443"],
            &["agent.metrics.port", "agent.port"],
        ),
    ];
    for (args, names) in cases {
        let message = refused(args);
        for name in names {
            assert!(
                message.contains(name),
                "{args:?}: the refusal does not name {name}:\n{message}"
            );
        }
    }
    // Feature switches have one place: tuning.data may not set them behind `features`' back.
    let message = refused(&["--set", "tuning.data.features\\.repair=true"]);
    assert!(
        message.contains("tuning.data.features.repair") && message.contains("features.repair"),
        "{message}"
    );
}

/// The first object of `kind` in a rendering.
fn find<'a>(objects: &'a [Value], kind: &str) -> &'a Value {
    objects
        .iter()
        .find(|o| o["kind"] == kind)
        .unwrap_or_else(|| panic!("no {kind} rendered"))
}

#[test]
fn values_reach_their_objects() {
    let digest = format!("sha256:{}", "ab".repeat(32));
    let values = tempfile::NamedTempFile::new().unwrap();
    let file = json!({
        "images": {
            "agent": {"repository": "registry.example/nodekeeper-agent", "tag": "0.1.0", "digest": digest},
            "controller": {"repository": "registry.example/nodekeeper-controller", "tag": "0.1.0", "pullPolicy": "Always"},
            "pullSecrets": ["regcred"],
        },
        "features": {"repair": true, "gpu": false},
        "tuning": {"data": {"sweepInterval": "1m"}},
        "ociCredentials": {"existingSecret": "oci-api-key", "region": "us-ashburn-1"},
        "controller": {
            "replicas": 1,
            "priorityClassName": "system-cluster-critical",
            "resources": {"requests": {"cpu": "50m", "memory": "64Mi"}, "limits": {"memory": "512Mi"}},
            "nodeSelector": {"pool": "system"},
            "tolerations": [{"key": "CriticalAddonsOnly", "operator": "Exists"}],
        },
        "agent": {
            "priorityClassName": "nodekeeper-agent",
            "nodeSelector": {"pool": "gpu"},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "resources": {"requests": {"cpu": "20m", "memory": "32Mi"}, "limits": {"memory": "128Mi"}},
            "hostMounts": {"kmsg": false, "journal": false},
            "port": 9555,
            // Rendered only, never contacted: a test sends nothing to the metadata service.
            "imdsEndpoint": "http://169.254.169.254",
            "metrics": {"port": 9556},
        },
        "commonLabels": {"team": "nodes"},
    });
    std::fs::write(values.path(), serde_json::to_string(&file).unwrap()).unwrap();
    let objects = helm_template("kube-system", &["-f", values.path().to_str().unwrap()])
        .unwrap_or_else(|e| panic!("{e}"));

    let agent = find(&objects, "DaemonSet");
    let pod = &agent["spec"]["template"]["spec"];
    let container = &pod["containers"][0];
    assert_eq!(
        container["image"],
        format!("registry.example/nodekeeper-agent@{digest}")
    );
    assert_eq!(pod["priorityClassName"], "nodekeeper-agent");
    assert_eq!(pod["nodeSelector"], json!({"pool": "gpu"}));
    assert_eq!(pod["tolerations"], file["agent"]["tolerations"]);
    assert_eq!(pod["imagePullSecrets"], json!([{"name": "regcred"}]));
    assert_eq!(container["resources"], file["agent"]["resources"]);
    assert_eq!(container["ports"][0]["containerPort"], 9555);
    let env = |c: &Value, name: &str| {
        c["env"]
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["name"] == name)
            .map(|e| e["value"].clone())
    };
    assert_eq!(
        env(container, "NODEKEEPER_LISTEN"),
        Some(json!("[::]:9555"))
    );
    assert_eq!(
        env(container, "NODEKEEPER_IMDS_ENDPOINT"),
        Some(json!("http://169.254.169.254"))
    );
    // agent.metrics: /metrics on the node's address (the downward API's status.hostIP).
    assert_eq!(
        container["ports"][1],
        json!({"name": "metrics", "containerPort": 9556, "protocol": "TCP"})
    );
    assert_eq!(
        env(container, "NODEKEEPER_METRICS_LISTEN"),
        Some(json!("$(NODE_IP):9556"))
    );
    // features.repair: /proc/sys writable at /host/sysctl, as the kustomize repair component.
    assert_eq!(
        env(container, "NODEKEEPER_SYSCTL_ROOT"),
        Some(json!("/host/sysctl"))
    );
    let mounts: Vec<&str> = container["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["mountPath"].as_str().unwrap())
        .collect();
    assert!(mounts.contains(&"/host/sysctl"), "{mounts:?}");
    assert!(
        !mounts.contains(&"/dev/kmsg") && !mounts.contains(&"/var/log"),
        "{mounts:?}"
    );
    assert_eq!(
        env(container, "NODEKEEPER_KERNEL_MONITOR"),
        Some(json!("false"))
    );
    assert_eq!(agent["metadata"]["namespace"], "kube-system");
    assert_eq!(agent["metadata"]["labels"]["team"], "nodes");
    assert_eq!(
        agent["spec"]["selector"]["matchLabels"],
        json!({"app.kubernetes.io/name": "nodekeeper-agent"}),
        "commonLabels must not change selectors (they are immutable)"
    );

    let controller = find(&objects, "Deployment");
    let pod = &controller["spec"]["template"]["spec"];
    let container = &pod["containers"][0];
    assert_eq!(controller["spec"]["replicas"], 1);
    assert_eq!(
        container["image"],
        "registry.example/nodekeeper-controller:0.1.0"
    );
    assert_eq!(container["imagePullPolicy"], "Always");
    assert_eq!(pod["priorityClassName"], "system-cluster-critical");
    assert_eq!(pod["nodeSelector"], json!({"pool": "system"}));
    assert_eq!(pod["tolerations"], file["controller"]["tolerations"]);
    assert_eq!(container["resources"], file["controller"]["resources"]);
    assert_eq!(
        env(container, "NODEKEEPER_OCI_CREDENTIALS_DIR"),
        Some(json!("/etc/nodekeeper/oci"))
    );
    assert_eq!(
        env(container, "NODEKEEPER_OCI_REGION"),
        Some(json!("us-ashburn-1"))
    );
    // The controller calls the agents on the port they listen on.
    assert_eq!(env(container, "NODEKEEPER_AGENT_PORT"), Some(json!("9555")));
    // ... and manages the nodes they run on (agent.nodeSelector), not every node.
    assert_eq!(
        env(container, "NODEKEEPER_NODE_SELECTOR"),
        Some(json!("pool=gpu"))
    );
    assert!(
        pod["volumes"]
            .as_array()
            .unwrap()
            .iter()
            .any(|v| v["secret"]["secretName"] == "oci-api-key"),
        "{pod}"
    );

    let tuning = find(&objects, "ConfigMap");
    assert_eq!(tuning["data"]["features.repair"], "true");
    assert_eq!(tuning["data"]["features.gpu"], "false");
    assert_eq!(tuning["data"]["features.tunables"], "true");
    assert_eq!(tuning["data"]["sweepInterval"], "1m");
    // The binding follows the release namespace.
    let binding = find(&objects, "ClusterRoleBinding");
    assert_eq!(binding["subjects"][0]["namespace"], "kube-system");
}

/// The controller's `NODEKEEPER_NODE_SELECTOR` in a rendering with `values`, if set.
fn managed_nodes(values: &Value) -> Option<String> {
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), serde_json::to_string(values).unwrap()).unwrap();
    let objects = helm_template("nodekeeper", &["-f", file.path().to_str().unwrap()])
        .unwrap_or_else(|e| panic!("{e}"));
    let container = &find(&objects, "Deployment")["spec"]["template"]["spec"]["containers"][0];
    container["env"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["name"] == "NODEKEEPER_NODE_SELECTOR")
        .map(|e| e["value"].as_str().unwrap().to_owned())
}

/// Regression: `agent.nodeSelector` placed the agents on some nodes while the controller managed
/// every Node, so each node without an agent went NodekeeperReachable=False and kept
/// NodekeeperAgentStale firing. The controller's --node-selector now selects exactly the nodes
/// the agent's nodeSelector does (as the controller parses it), unless
/// `controller.managedNodeSelector` says otherwise; with neither, every Node, as `deploy/`.
#[test]
fn the_controller_manages_the_nodes_the_agent_runs_on() {
    use nodekeeper_api::selector;

    assert_eq!(managed_nodes(&json!({})), None, "every Node by default");
    let agent_selector = json!({"pool": "gpu", "nodekeeper.dev/managed": ""});
    let rendered = managed_nodes(&json!({"agent": {"nodeSelector": agent_selector}}))
        .expect("agent.nodeSelector reaches the controller");
    assert_eq!(rendered, "nodekeeper.dev/managed=,pool=gpu");
    let parsed = selector::parse(&rendered).unwrap_or_else(|e| panic!("{rendered}: {e}"));
    assert_eq!(selector::check(&parsed), Ok(()), "{rendered}");
    let labels = |pairs: &[(&str, &str)]| -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    };
    // The agent's node (its nodeSelector's labels, and others) is managed; a node of another
    // pool, or one without the label, is not.
    assert!(parsed.matches(&labels(&[
        ("pool", "gpu"),
        ("nodekeeper.dev/managed", ""),
        ("zone", "a")
    ])));
    assert!(!parsed.matches(&labels(&[("pool", "cpu"), ("nodekeeper.dev/managed", "")])));
    assert!(!parsed.matches(&labels(&[("pool", "gpu")])));

    // The dedicated value wins, as given.
    let explicit = "pool in (gpu,cpu),!spot";
    assert_eq!(
        managed_nodes(&json!({
            "agent": {"nodeSelector": {"pool": "gpu"}},
            "controller": {"managedNodeSelector": explicit},
        }))
        .as_deref(),
        Some(explicit)
    );
    assert_eq!(
        managed_nodes(&json!({"controller": {"managedNodeSelector": explicit}})).as_deref(),
        Some(explicit)
    );
    // A map (agent.nodeSelector's shape) is refused, naming the value.
    let message = refused(&[
        "--set-json",
        r#"controller.managedNodeSelector={"pool":"gpu"}"#,
    ]);
    assert!(
        message.contains("managedNodeSelector") && message.contains("string"),
        "{message}"
    );
}

/// `agent.metrics.enabled=false` serves no metrics: no listener, no port, no agent PodMonitor
/// (the controller's stays).
#[test]
fn agent_metrics_turn_off() {
    let objects = helm_template(
        "nodekeeper",
        &[
            "--set",
            "agent.metrics.enabled=false,monitoring.podMonitor.enabled=true",
        ],
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let container = &find(&objects, "DaemonSet")["spec"]["template"]["spec"]["containers"][0];
    let names = |list: &Value| -> Vec<String> {
        list.as_array()
            .unwrap()
            .iter()
            .map(|e| e["name"].as_str().unwrap().to_owned())
            .collect()
    };
    let env = names(&container["env"]);
    assert!(
        !env.contains(&"NODEKEEPER_METRICS_LISTEN".to_owned())
            && !env.contains(&"NODE_IP".to_owned()),
        "{env:?}"
    );
    assert_eq!(names(&container["ports"]), ["grpc"]);
    let monitors: Vec<&Value> = objects
        .iter()
        .filter(|o| o["kind"] == "PodMonitor")
        .map(|o| &o["metadata"]["name"])
        .collect();
    assert_eq!(monitors, [&json!("nodekeeper-controller")]);
}

/// One row of `deploy/oke/addon-configuration.yaml`.
#[derive(serde::Deserialize)]
struct Argument {
    key: String,
    value: String,
    #[serde(rename = "type")]
    kind: String,
    default: String,
}

fn oke_arguments() -> Vec<Argument> {
    #[derive(serde::Deserialize)]
    struct File {
        arguments: Vec<Argument>,
    }
    let text = std::fs::read_to_string(repo().join("deploy/oke/addon-configuration.yaml"))
        .expect("read deploy/oke/addon-configuration.yaml");
    serde_yaml::from_str::<File>(&text)
        .expect("parse deploy/oke/addon-configuration.yaml")
        .arguments
}

/// The path segments of a dotted chart value (`\.` is a dot inside a key).
fn segments(path: &str) -> Vec<String> {
    let mut out = vec![String::new()];
    let mut chars = path.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\\' if chars.peek() == Some(&'.') => {
                out.last_mut().unwrap().push('.');
                chars.next();
            }
            '.' => out.push(String::new()),
            c => out.last_mut().unwrap().push(c),
        }
    }
    out
}

/// An argument's value as the chart value it sets.
fn convert(argument: &Argument, raw: &str) -> Result<Value, String> {
    let bad = |why: &str| format!("OKE argument {}={raw:?}: {why}", argument.key);
    match argument.kind.as_str() {
        "string" => Ok(Value::String(raw.to_owned())),
        "integer" => raw
            .trim()
            .parse::<i64>()
            .map(Value::from)
            .map_err(|_| bad("expected an integer")),
        "boolean" => match raw.trim() {
            "true" => Ok(Value::Bool(true)),
            "false" => Ok(Value::Bool(false)),
            _ => Err(bad("expected true or false")),
        },
        "json" => serde_json::from_str(raw).or_else(|_| {
            use base64::Engine as _;
            let decoded = base64::engine::general_purpose::STANDARD
                .decode(raw.trim())
                .map_err(|_| bad("expected JSON text, plain or base64-encoded"))?;
            serde_json::from_slice(&decoded)
                .map_err(|e| bad(&format!("base64 decodes to no JSON: {e}")))
        }),
        "image" => {
            if let Some((repository, digest)) = raw.split_once('@') {
                return Ok(json!({"repository": repository, "digest": digest}));
            }
            match raw.rsplit_once(':').filter(|(_, tag)| !tag.contains('/')) {
                Some((repository, tag)) => Ok(json!({"repository": repository, "tag": tag})),
                None => Ok(json!({"repository": raw, "tag": "latest"})),
            }
        }
        other => Err(format!(
            "deploy/oke/addon-configuration.yaml: {} has unknown type {other}",
            argument.key
        )),
    }
}

/// OKE add-on arguments → Helm values, by the mapping file. Unknown keys are refused.
fn oke_values(arguments: &[(&str, &str)]) -> Result<Value, String> {
    let mapping = oke_arguments();
    let mut values = json!({});
    for (key, raw) in arguments {
        let argument = mapping.iter().find(|a| a.key == *key).ok_or_else(|| {
            format!("OKE argument {key} is not a nodekeeper configuration argument (see deploy/oke/addon-configuration.yaml)")
        })?;
        let value = convert(argument, raw)?;
        let path = segments(&argument.value);
        let mut at = &mut values;
        for segment in &path[..path.len() - 1] {
            at = at
                .as_object_mut()
                .unwrap()
                .entry(segment.clone())
                .or_insert_with(|| json!({}));
        }
        at[path.last().unwrap().as_str()] = value;
    }
    Ok(values)
}

/// The chart's default at a dotted path of values.yaml.
fn chart_default(path: &str) -> Option<Value> {
    let text = std::fs::read_to_string(chart_dir().join("values.yaml")).unwrap();
    let mut at: Value = serde_yaml::from_str(&text).unwrap();
    for segment in segments(path) {
        at = at.get(&segment)?.clone();
    }
    Some(at)
}

#[test]
fn oke_addon_arguments_map_onto_the_chart_and_the_tuning_configmap() {
    let mapping = oke_arguments();
    // Each documented default is the chart's default, so the table cannot drift from values.yaml.
    for argument in &mapping {
        if argument.default.starts_with('(') {
            continue;
        }
        let documented = convert(argument, &argument.default).unwrap();
        let mut chart = chart_default(&argument.value)
            .unwrap_or_else(|| panic!("{}: no chart value {}", argument.key, argument.value));
        if argument.kind == "image" {
            chart = json!({"repository": chart["repository"], "tag": chart["tag"]});
        }
        assert_eq!(
            documented, chart,
            "{}: documented default vs values.yaml",
            argument.key
        );
    }

    use base64::Engine as _;
    let tolerations = base64::engine::general_purpose::STANDARD
        .encode(r#"[{"key":"pool","operator":"Equal","value":"gpu","effect":"NoSchedule"}]"#);
    let arguments = [
        (
            "controllerImage",
            "iad.ocir.io/tenancy/nodekeeper-controller:0.1.0",
        ),
        (
            "agentImage",
            &format!(
                "iad.ocir.io/tenancy/nodekeeper-agent@sha256:{}",
                "c".repeat(64)
            ),
        ),
        ("numOfReplicas", "1"),
        ("agentTolerations", &tolerations),
        (
            "agentNodeSelectors",
            r#"{"node.kubernetes.io/instance-type":"BM.GPU.H100.8"}"#,
        ),
        (
            "controllerContainerResources",
            r#"{"requests":{"cpu":"200m","memory":"256Mi"},"limits":{"memory":"1Gi"}}"#,
        ),
        ("featureRepair", "true"),
        ("sweepInterval", "2m"),
        ("ociCredentialsSecret", "oci-api-key"),
        ("agentPriorityClassName", "system-cluster-critical"),
        ("agentMetricsPort", "9556"),
        ("agentPort", "9445"),
        ("ociRegion", "us-ashburn-1"),
        ("agentImdsEndpoint", "http://169.254.169.254"),
    ];
    let values = oke_values(&arguments).unwrap_or_else(|e| panic!("{e}"));
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), serde_json::to_string(&values).unwrap()).unwrap();
    let objects = helm_template("nodekeeper", &["-f", file.path().to_str().unwrap()])
        .unwrap_or_else(|e| panic!("{e}"));
    let controller = find(&objects, "Deployment");
    let agent = find(&objects, "DaemonSet");
    let tuning = find(&objects, "ConfigMap");
    let cpod = &controller["spec"]["template"]["spec"];
    let apod = &agent["spec"]["template"]["spec"];
    assert_eq!(
        cpod["containers"][0]["image"],
        "iad.ocir.io/tenancy/nodekeeper-controller:0.1.0"
    );
    assert_eq!(
        apod["containers"][0]["image"],
        format!(
            "iad.ocir.io/tenancy/nodekeeper-agent@sha256:{}",
            "c".repeat(64)
        )
    );
    assert_eq!(controller["spec"]["replicas"], 1);
    assert_eq!(apod["tolerations"][0]["value"], "gpu");
    assert_eq!(
        apod["nodeSelector"]["node.kubernetes.io/instance-type"],
        "BM.GPU.H100.8"
    );
    assert_eq!(
        cpod["containers"][0]["resources"]["limits"]["memory"],
        "1Gi"
    );
    assert_eq!(apod["priorityClassName"], "system-cluster-critical");
    let has_env = |c: &Value, name: &str, value: &str| {
        c["env"]
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e["name"] == name && e["value"] == value)
    };
    let ccontainer = &cpod["containers"][0];
    assert!(
        has_env(ccontainer, "NODEKEEPER_AGENT_PORT", "9445")
            && has_env(ccontainer, "NODEKEEPER_OCI_REGION", "us-ashburn-1"),
        "{ccontainer:#}"
    );
    // The controller manages the nodes agentNodeSelectors puts the agent on ...
    assert!(
        has_env(
            ccontainer,
            "NODEKEEPER_NODE_SELECTOR",
            "node.kubernetes.io/instance-type=BM.GPU.H100.8"
        ),
        "{ccontainer:#}"
    );
    // ... or those managedNodeSelector names.
    let values = oke_values(&[
        ("agentNodeSelectors", r#"{"pool":"gpu"}"#),
        ("managedNodeSelector", "pool in (gpu,gpu-spare)"),
    ])
    .unwrap();
    assert_eq!(
        managed_nodes(&values).as_deref(),
        Some("pool in (gpu,gpu-spare)")
    );
    let container = &apod["containers"][0];
    assert!(
        has_env(container, "NODEKEEPER_LISTEN", "[::]:9445")
            && has_env(
                container,
                "NODEKEEPER_IMDS_ENDPOINT",
                "http://169.254.169.254"
            ),
        "{container:#}"
    );
    assert!(
        container["ports"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p["name"] == "metrics" && p["containerPort"] == 9556),
        "{container:#}"
    );
    assert!(
        container["env"]
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e["name"] == "NODEKEEPER_METRICS_LISTEN" && e["value"] == "$(NODE_IP):9556"),
        "{container:#}"
    );
    // Off: no listener, no port.
    let off = oke_values(&[("agentMetricsEnabled", "false")]).unwrap();
    std::fs::write(file.path(), serde_json::to_string(&off).unwrap()).unwrap();
    let objects = helm_template("nodekeeper", &["-f", file.path().to_str().unwrap()])
        .unwrap_or_else(|e| panic!("{e}"));
    let text = serde_json::to_string(&find(&objects, "DaemonSet")).unwrap();
    assert!(
        !text.contains("METRICS_LISTEN") && !text.contains("9444"),
        "{text}"
    );
    assert_eq!(tuning["data"]["features.repair"], "true");
    assert_eq!(tuning["data"]["sweepInterval"], "2m");
    assert!(
        tuning["data"]["rules.yaml"]
            .as_str()
            .unwrap()
            .contains("somaxconn")
    );

    // Refusals name the argument.
    let error = oke_values(&[("numOfReplica", "1")]).unwrap_err();
    assert!(error.contains("numOfReplica"), "{error}");
    let error = oke_values(&[("numOfReplicas", "two")]).unwrap_err();
    assert!(
        error.contains("numOfReplicas") && error.contains("integer"),
        "{error}"
    );
    let error = oke_values(&[("agentTolerations", "not json")]).unwrap_err();
    assert!(
        error.contains("agentTolerations") && error.contains("JSON"),
        "{error}"
    );
    // A value of the right shape that the chart refuses is refused by its schema.
    let values = oke_values(&[("numOfReplicas", "7")]).unwrap();
    std::fs::write(file.path(), serde_json::to_string(&values).unwrap()).unwrap();
    let message = refused(&["-f", file.path().to_str().unwrap()]);
    assert!(message.contains("replicas"), "{message}");
}

/// The chart's alerts pass `promtool check rules`, and `promtool test rules` fires each on the
/// series that should fire it (deploy/monitoring/rules-test.yaml); the monitoring objects render
/// and carry those rules and a dashboard whose every panel has a query.
#[test]
fn monitoring_rules_pass_promtool_and_render() {
    let Some(promtool) = std::env::var_os("PATH").and_then(|path| {
        std::env::split_paths(&path)
            .map(|d| d.join("promtool"))
            .find(|p| p.is_file())
    }) else {
        nodekeeper_testkit::skip!(
            "promtool not on PATH (Debian's `prometheus` package; `cargo xtask test` installs it as root)"
        );
    };
    let rules = chart_dir().join("files/prometheus-rules.yaml");
    let out = run(&promtool, &["check", "rules", rules.to_str().unwrap()])
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(out.contains("SUCCESS"), "{out}");
    let tests = repo().join("deploy/monitoring/rules-test.yaml");
    let out = run(&promtool, &["test", "rules", tests.to_str().unwrap()])
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(out.contains("SUCCESS"), "{out}");
    // Every alert of the rules file has a firing case in the test file.
    let text = std::fs::read_to_string(&rules).unwrap();
    let tested = std::fs::read_to_string(&tests).unwrap();
    let alerts: Vec<&str> = text
        .lines()
        .filter_map(|l| l.trim().strip_prefix("- alert: "))
        .collect();
    assert!(alerts.len() >= 5, "{alerts:?}");
    // The commands name the namespace the series come from (`{{ $labels.namespace }}`), not
    // the default one: the chart installs into any namespace.
    for fixed in ["-n nodekeeper ", "namespaces/nodekeeper/"] {
        assert!(
            !text.contains(fixed),
            "files/prometheus-rules.yaml names the namespace `nodekeeper` ({fixed:?}); use {{{{ $labels.namespace }}}}"
        );
    }
    let tested: Value = serde_yaml::from_str(&tested).unwrap();
    let firing: Vec<&str> = tested["tests"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|t| t["alert_rule_test"].as_array().unwrap())
        .filter(|c| c["exp_alerts"].as_array().is_some_and(|a| !a.is_empty()))
        .map(|c| c["alertname"].as_str().unwrap())
        .collect();
    for alert in &alerts {
        assert!(
            firing.contains(alert),
            "{alert} has no firing case in deploy/monitoring/rules-test.yaml"
        );
    }

    let objects = helm_template(
        "nodekeeper",
        &[
            "--set",
            "monitoring.podMonitor.enabled=true,monitoring.prometheusRule.enabled=true,monitoring.dashboard.enabled=true",
        ],
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let rule = find(&objects, "PrometheusRule");
    let rendered: Vec<&str> = rule["spec"]["groups"][0]["rules"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["alert"].as_str().unwrap())
        .collect();
    assert_eq!(rendered, alerts);
    let monitors: Vec<(&Value, &Value)> = objects
        .iter()
        .filter(|o| o["kind"] == "PodMonitor")
        .map(|o| {
            (
                &o["metadata"]["name"],
                &o["spec"]["podMetricsEndpoints"][0]["port"],
            )
        })
        .collect();
    assert_eq!(
        monitors,
        [
            (&json!("nodekeeper-controller"), &json!("http")),
            (&json!("nodekeeper-agent"), &json!("metrics")),
        ]
    );
    let dashboard = objects
        .iter()
        .find(|o| o["metadata"]["name"] == "nodekeeper-dashboard")
        .expect("the dashboard ConfigMap");
    let json: Value =
        serde_json::from_str(dashboard["data"]["nodekeeper-fleet.json"].as_str().unwrap()).unwrap();
    let panels = json["panels"].as_array().unwrap();
    assert!(panels.len() >= 8);
    for panel in panels {
        let expr = panel["targets"][0]["expr"].as_str().unwrap_or_default();
        // nodekeeper's series, or node-problem-detector's under its own name (the agents').
        assert!(
            expr.contains("nodekeeper_") || expr.contains("problem_gauge"),
            "{}: {expr}",
            panel["title"]
        );
    }
}
