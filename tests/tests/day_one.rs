//! Day one on a real cluster (needs root: network namespaces, a private mount namespace).
//!
//! The packaged install on an empty node, kubeadm's own kube-proxy ConfigMap, a Node object
//! that arrives late or cannot be watched, a slow initial list, and the health server on a
//! dual-stack node. The API server speaks HTTPS with a cluster CA and requires the
//! ServiceAccount token wherever the agent runs as a pod would.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::time::{Duration, Instant};

use nftproxy_tests::apiserver::{ApiServer, in_netns};
use nftproxy_tests::cluster::node as node_object;
use nftproxy_tests::connect_loop::{ConnectLoop, Counts};
use nftproxy_tests::pod::{Container, Packaging, PodEnv, SERVICE_ACCOUNT_DIR};
use nftproxy_tests::{Lab, Ns, Probe, Proc, Proto, Verdict, ip, sa, target_binary};
use serde_json::{Value, json};

const NODE: &str = "test-node";
const NODE_IP: &str = "192.0.2.1";
const API_IP: &str = "192.0.2.10";
const KUBERNETES_IP: &str = "10.96.0.1";
const WEB_IP: &str = "10.96.0.50";
const NODE_PORT: u16 = 30080;

/// A node with a control-plane host on its uplink (the API server on 192.0.2.10:6443), a
/// client pod and one endpoint pod.
struct Site {
    lab: Lab,
    node: Ns,
    control_plane: Ns,
    client: Ns,
    api: ApiServer,
    dir: tempfile::TempDir,
}

fn site() -> Site {
    let lab = Lab::with_nettest(env!("CARGO_BIN_EXE_nettest")).unwrap();
    let node = lab.node("node").unwrap();
    let control_plane = lab
        .external(&node, "cp", &[ip(API_IP)], &[ip(NODE_IP)])
        .unwrap();
    // Like a real node: whatever is not local goes out of the uplink.
    let up = control_plane.node_link().unwrap().to_string();
    node.add_route(&format!("default dev {up}")).unwrap();
    let client = lab.pod(&node, "client", &[ip("10.180.0.2")]).unwrap();
    let ep = lab.pod(&node, "ep", &[ip("10.180.0.1")]).unwrap();
    lab.echo(&ep, &[80]).unwrap();
    let api = ApiServer::builder()
        .netns(control_plane.name())
        .bind(ip(API_IP))
        .port(6443)
        .tls(true)
        .require_token(true)
        .san(ip(KUBERNETES_IP))
        .start()
        .unwrap();
    for obj in cluster_objects() {
        api.apply(obj).unwrap();
    }
    Site {
        lab,
        node,
        control_plane,
        client,
        api,
        dir: tempfile::tempdir().unwrap(),
    }
}

/// The `default/kubernetes` Service (pointing at the API server), a NodePort Service `web`,
/// and this node's Node object.
fn cluster_objects() -> Vec<Value> {
    vec![
        node_object(NODE, &[NODE_IP], &[]),
        service("default", "kubernetes", KUBERNETES_IP, 443, "https", None),
        slice("default", "kubernetes", "https", 6443, API_IP),
        service("ns", "web", WEB_IP, 80, "http", Some(NODE_PORT)),
        slice("ns", "web", "http", 80, "10.180.0.1"),
    ]
}

fn service(
    ns: &str,
    name: &str,
    ip: &str,
    port: u16,
    port_name: &str,
    node_port: Option<u16>,
) -> Value {
    let mut port = json!({"name": port_name, "port": port, "protocol": "TCP"});
    let mut spec = json!({"clusterIP": ip, "clusterIPs": [ip], "type": "ClusterIP"});
    if let Some(np) = node_port {
        port["nodePort"] = json!(np);
        spec["type"] = json!("NodePort");
    }
    spec["ports"] = json!([port]);
    json!({"apiVersion": "v1", "kind": "Service",
           "metadata": {"name": name, "namespace": ns}, "spec": spec})
}

fn slice(ns: &str, service: &str, port_name: &str, port: u16, addr: &str) -> Value {
    json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": format!("{service}-1"), "namespace": ns,
                     "labels": {"kubernetes.io/service-name": service}},
        "addressType": "IPv4",
        "ports": [{"name": port_name, "port": port, "protocol": "TCP"}],
        "endpoints": [{"addresses": [addr], "conditions": {"ready": true}}]
    })
}

fn pod_env(api: &ApiServer) -> PodEnv {
    PodEnv {
        node_name: NODE.into(),
        kubernetes_service: (KUBERNETES_IP.into(), 443),
        service_account: [
            ("token".to_string(), api.token().to_string()),
            ("ca.crt".to_string(), api.ca_pem().expect("TLS").to_string()),
            ("namespace".to_string(), "kube-system".to_string()),
        ]
        .into(),
    }
}

fn nftproxy() -> std::path::PathBuf {
    target_binary("nftproxy").expect("build nftproxy first")
}

/// Probes the `web` Service from the client pod until its endpoint answers.
fn web_answers_within(site: &Site, within: Duration) -> Duration {
    let start = Instant::now();
    let want = Verdict::Endpoints {
        set: [sa("10.180.0.1:80")].into(),
        masqueraded: false,
    };
    loop {
        let probe = Probe::new(Proto::Tcp, sa(&format!("{WEB_IP}:80")), 3)
            .timeout(Duration::from_millis(300));
        let got = site
            .lab
            .probe_for(&site.client, &probe, &want)
            .unwrap()
            .verdict();
        if got == want {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < within,
            "web: still {got:?} after {within:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// One HTTP/1.0 GET from inside `ns`: (status, body).
fn http_get(ns: &Ns, addr: SocketAddr, path: &str) -> std::io::Result<(u16, String)> {
    let path = path.to_string();
    in_netns(ns.name(), move || {
        let mut c = TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
        c.set_read_timeout(Some(Duration::from_secs(2)))?;
        write!(c, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n")?;
        let mut text = String::new();
        c.read_to_string(&mut text)?;
        let status = text
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        let body = text
            .split_once("\r\n\r\n")
            .map(|(_, b)| b.to_string())
            .unwrap_or_default();
        Ok((status, body))
    })
    .expect("entering the namespace")
}

fn empty_ruleset(ns: &Ns) {
    let rules = ns.exec(&["nft", "list", "ruleset"]).unwrap();
    assert!(rules.trim().is_empty(), "not an empty node:\n{rules}");
}

#[test]
fn the_packaged_install_boots_on_an_empty_node() {
    nftproxy_tests::require_root!();
    let site = site();
    empty_ruleset(&site.node);
    let mut packaging = Packaging::load().unwrap();
    // The documented single edit: the control plane's address for the API client.
    let endpoint = packaging
        .object_mut("ConfigMap", "nftproxy-api-server")
        .expect("packaging/ ships the nftproxy-api-server ConfigMap");
    endpoint["data"] = json!({
        "KUBERNETES_SERVICE_HOST": API_IP,
        "KUBERNETES_SERVICE_PORT": "6443",
    });
    set_cluster_cidr(&mut packaging);
    let container = Container::from_packaging(&packaging, &pod_env(&site.api)).unwrap();
    let started = Instant::now();
    let agent = container
        .spawn(&site.node, &nftproxy(), site.dir.path())
        .unwrap();
    let took = web_answers_within(&site, Duration::from_secs(10));
    eprintln!("traffic after {took:?}; {:?} since exec", started.elapsed());
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:#?}",
        agent.stderr()
    );
    // The kubernetes Service now leads to the API server, from pods too.
    let kubernetes: SocketAddr = format!("{KUBERNETES_IP}:443").parse().unwrap();
    in_netns(site.client.name(), || {
        TcpStream::connect_timeout(&kubernetes, Duration::from_secs(2))
            .expect("kubernetes ClusterIP")
    })
    .unwrap();
    // Every request carried the ServiceAccount token: none was refused.
    let refused: Vec<_> = site
        .api
        .requests()
        .into_iter()
        .filter(|r| r.status == Some(401))
        .collect();
    assert!(refused.is_empty(), "{refused:#?}");
    let (code, _) = http_get(&site.node, sa("127.0.0.1:10256"), "/healthz").unwrap();
    assert_eq!(code, 200, "{:#?}", agent.stderr());
}

/// The other documented edit: the cluster's pod CIDR in the ConfigMap's config.conf.
fn set_cluster_cidr(packaging: &mut Packaging) {
    let cm = packaging
        .object_mut("ConfigMap", "nftproxy")
        .expect("packaging/ ships the nftproxy ConfigMap");
    let conf = cm["data"]["config.conf"]
        .as_str()
        .expect("config.conf")
        .to_string();
    assert!(conf.contains("\nclusterCIDR: "), "{conf}");
    let edited: Vec<String> = conf
        .lines()
        .map(|l| {
            if l.starts_with("clusterCIDR:") {
                "clusterCIDR: 10.180.0.0/16".to_string()
            } else {
                l.to_string()
            }
        })
        .collect();
    cm["data"]["config.conf"] = json!(edited.join("\n"));
}

#[test]
fn without_the_endpoint_edit_the_log_and_healthz_name_the_problem() {
    nftproxy_tests::require_root!();
    let site = site();
    let mut packaging = Packaging::load().unwrap();
    set_cluster_cidr(&mut packaging);
    let container = Container::from_packaging(&packaging, &pod_env(&site.api)).unwrap();
    assert_eq!(
        container.env["KUBERNETES_SERVICE_HOST"], KUBERNETES_IP,
        "unedited packaging"
    );
    let agent = container
        .spawn(&site.node, &nftproxy(), site.dir.path())
        .unwrap();
    let line = agent
        .wait_stderr(
            |l| l.contains("cannot reach the API server") && l.contains("default/kubernetes"),
            Duration::from_secs(40),
        )
        .unwrap_or_else(|e| panic!("{e:#}: {:#?}", agent.stderr()));
    assert!(
        line.contains("KUBERNETES_SERVICE_HOST"),
        "the fix is named: {line}"
    );
    let (code, body) = http_get(&site.node, sa("127.0.0.1:10256"), "/healthz").unwrap();
    assert_eq!(code, 503, "{body}");
    let health: Value = serde_json::from_str(&body).unwrap();
    let problem = health["apiServer"].as_str().unwrap_or_default();
    assert!(
        problem.contains(KUBERNETES_IP) && problem.contains("nftproxy-api-server"),
        "{body}"
    );
    // Liveness is not failed for it: a restart would not help.
    let (code, _) = http_get(&site.node, sa("127.0.0.1:10256"), "/livez").unwrap();
    assert_eq!(code, 200);
}

/// kubeadm's `kube-proxy` ConfigMap: `config.conf` exactly as kubeadm writes it (every field,
/// zero values; the pod subnet is the lab's) and `kubeconfig.conf` with the control-plane
/// endpoint and the ServiceAccount's CA and token.
const KUBEADM_CONFIG: &str = include_str!("../fixtures/kubeadm-kube-proxy-config.conf");

fn kubeadm_kubeconfig() -> String {
    format!(
        "apiVersion: v1
kind: Config
clusters:
- cluster:
    certificate-authority: {SERVICE_ACCOUNT_DIR}/ca.crt
    server: https://{API_IP}:6443
  name: default
contexts:
- context:
    cluster: default
    namespace: default
    user: default
  name: default
current-context: default
users:
- name: default
  user:
    tokenFile: {SERVICE_ACCOUNT_DIR}/token
"
    )
}

#[test]
fn kubeadms_own_configmap_works_unchanged() {
    nftproxy_tests::require_root!();
    let site = site();
    let pod = pod_env(&site.api);
    // kubeadm's DaemonSet: the ConfigMap at /var/lib/kube-proxy, the node name from the
    // downward API, and the kubelet's variables for the kubernetes Service.
    let mut files: BTreeMap<_, _> = [
        (
            "/var/lib/kube-proxy/config.conf".into(),
            KUBEADM_CONFIG.to_string(),
        ),
        (
            "/var/lib/kube-proxy/kubeconfig.conf".into(),
            kubeadm_kubeconfig(),
        ),
    ]
    .into();
    for (k, v) in &pod.service_account {
        files.insert(Path::new(SERVICE_ACCOUNT_DIR).join(k), v.clone());
    }
    let container = Container {
        args: vec![
            "run".into(),
            "--config=/var/lib/kube-proxy/config.conf".into(),
            format!("--hostname-override={NODE}"),
        ],
        env: [
            ("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"),
            ("NODE_NAME", NODE),
            ("KUBERNETES_SERVICE_HOST", KUBERNETES_IP),
            ("KUBERNETES_SERVICE_PORT", "443"),
            ("KUBERNETES_PORT", "tcp://10.96.0.1:443"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect(),
        files,
    };
    let agent = container
        .spawn(&site.node, &nftproxy(), site.dir.path())
        .unwrap();
    web_answers_within(&site, Duration::from_secs(15));
    for path in ["/healthz", "/livez"] {
        let (code, body) = http_get(&site.node, sa("127.0.0.1:10256"), path).unwrap();
        assert_eq!(code, 200, "{path}: {body}\n{:#?}", agent.stderr());
    }
    let (code, body) = http_get(&site.node, sa("127.0.0.1:10249"), "/metrics").unwrap();
    assert_eq!(code, 200);
    assert!(
        body.contains("kubeproxy_sync_proxy_rules_last_timestamp_seconds"),
        "{body}"
    );
    // The client's requests and the process, as kube-prometheus's kube-proxy dashboard reads them.
    let host = format!("host=\"{API_IP}:6443\"");
    assert!(
        body.lines()
            .any(|l| l.starts_with("rest_client_requests_total{")
                && l.contains("code=\"200\"")
                && l.contains(&host)
                && l.contains("method=\"GET\"")),
        "{body}"
    );
    assert!(body.contains("\nprocess_resident_memory_bytes "), "{body}");
    // Metrics stay on loopback (kube-proxy's default), health answers on the node's address.
    assert!(http_get(&site.node, sa(&format!("{NODE_IP}:10249")), "/metrics").is_err());
    let (code, _) = http_get(&site.node, sa(&format!("{NODE_IP}:10256")), "/healthz").unwrap();
    assert_eq!(code, 200);
    let (code, configz) = http_get(&site.node, sa("127.0.0.1:10249"), "/configz").unwrap();
    assert_eq!(code, 200);
    let configz: Value = serde_json::from_str(&configz).unwrap();
    let effective = &configz["kubeproxy.config.k8s.io"];
    assert_eq!(effective["nftables"]["syncPeriod"], "30s", "{configz}");
    assert_eq!(
        effective["healthzBindAddress"], "0.0.0.0:10256",
        "{configz}"
    );
    // The token was required and sent.
    assert!(site.api.requests().iter().all(|r| r.status != Some(401)));
    drop(agent);
}

fn wait_until(what: &str, within: Duration, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(start.elapsed() < within, "{what}: not within {within:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// An agent with the API server's kubeconfig and a short sync period.
fn agent_with(site: &Site, sync_period: &str) -> Proc {
    let kubeconfig = site.dir.path().join("kubeconfig");
    site.api
        .write_kubeconfig(
            &kubeconfig,
            &site.api.service_account_dir().join("ca.crt"),
            &site.api.service_account_dir().join("token"),
        )
        .unwrap();
    let config = site.dir.path().join("config.yaml");
    std::fs::write(
        &config,
        format!(
            "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n\
             clusterCIDR: 10.180.0.0/16\nhostnameOverride: {NODE}\n\
             nftables: {{syncPeriod: {sync_period}, minSyncPeriod: 100ms}}\n"
        ),
    )
    .unwrap();
    let bin = nftproxy();
    site.node
        .spawn(&[
            bin.to_str().unwrap(),
            "run",
            "--kubeconfig",
            kubeconfig.to_str().unwrap(),
            "--config",
            config.to_str().unwrap(),
        ])
        .unwrap()
}

#[test]
fn a_late_node_and_a_failing_node_watch_never_break_node_ports() {
    nftproxy_tests::require_root!();
    let site = site();
    site.api.delete("Node", "", NODE).unwrap();
    let mut agent = agent_with(&site, "30s");
    let node_port: SocketAddr = format!("{NODE_IP}:{NODE_PORT}").parse().unwrap();
    let prober = ConnectLoop::start(
        &site.control_plane,
        node_port,
        Duration::from_millis(50),
        Duration::from_millis(500),
    );
    std::thread::sleep(Duration::from_secs(5));
    assert_eq!(
        prober.counts().answered,
        0,
        "NodePorts answer only once the node's address is known"
    );
    site.api.apply(node_object(NODE, &[NODE_IP], &[])).unwrap();
    wait_until("NodePort answers", Duration::from_secs(10), || {
        prober.counts().answered > 0
    });
    std::thread::sleep(Duration::from_secs(2));
    // Deleting the Node keeps its address.
    site.api.delete("Node", "", NODE).unwrap();
    std::thread::sleep(Duration::from_secs(2));
    site.api.apply(node_object(NODE, &[NODE_IP], &[])).unwrap();
    // A restart while the Node cannot be watched: the rules in place keep serving, and the
    // first sync after the wait keeps the NodePort addresses.
    site.api.set_fail("nodes", Some(500));
    agent.terminate(Duration::from_secs(5)).unwrap();
    let agent = agent_with(&site, "30s");
    agent
        .wait_stderr(
            |l| l.contains("serving NodePorts on"),
            Duration::from_secs(40),
        )
        .unwrap_or_else(|e| panic!("{e:#}: {:#?}", agent.stderr()));
    agent
        .wait_stderr(
            |l| l.contains("nftables sync committed"),
            Duration::from_secs(10),
        )
        .unwrap();
    std::thread::sleep(Duration::from_secs(2));
    let Counts {
        answered: ok,
        failed_after_first: failed,
        ..
    } = prober.finish();
    assert!(ok > 200, "only {ok} answers");
    assert_eq!(
        failed,
        0,
        "{failed} of {} probes failed after the first answer",
        ok + failed
    );
}

#[test]
fn a_slow_initial_list_does_not_fail_livez() {
    nftproxy_tests::require_root!();
    let site = site();
    // Services are listed at once; EndpointSlices only after 3 x syncPeriod.
    site.api.set_fail("endpointslices", Some(500));
    let agent = agent_with(&site, "1s");
    let started = Instant::now();
    let mut checks = 0;
    while started.elapsed() < Duration::from_millis(3500) {
        let (code, body) =
            http_get(&site.node, sa("127.0.0.1:10256"), "/livez").unwrap_or_default();
        assert!(
            code == 200 || code == 0,
            "/livez {code} at {:?}: {body}",
            started.elapsed()
        );
        checks += usize::from(code == 200);
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        checks > 10,
        "the health server answered only {checks} times"
    );
    site.api.set_fail("endpointslices", None);
    web_answers_within(&site, Duration::from_secs(15));
    let (code, body) = http_get(&site.node, sa("127.0.0.1:10256"), "/livez").unwrap();
    assert_eq!(code, 200, "{body}\n{:#?}", agent.stderr());
}

#[test]
fn healthz_answers_on_ipv6_with_the_default_bind_address() {
    nftproxy_tests::require_root!();
    let lab = Lab::with_nettest(env!("CARGO_BIN_EXE_nettest")).unwrap();
    let node = lab.node("node").unwrap();
    let ext = lab
        .external(
            &node,
            "ext",
            &[ip("203.0.113.2"), ip("2001:db8::2")],
            &[ip("192.0.2.1"), ip("2001:db8::1")],
        )
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("cluster.yaml");
    std::fs::write(&input, "").unwrap();
    let config = dir.path().join("config.yaml");
    std::fs::write(&config, "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nhealthzBindAddress: \"\"\n").unwrap();
    let bin = nftproxy();
    let agent = node
        .spawn(&[
            bin.to_str().unwrap(),
            "run",
            "--from-file",
            input.to_str().unwrap(),
            "--config",
            config.to_str().unwrap(),
            "--hostname-override",
            "n1",
        ])
        .unwrap();
    agent
        .wait_stderr(
            |l| l.contains("serving") && l.contains("healthz"),
            Duration::from_secs(10),
        )
        .unwrap();
    for addr in ["[2001:db8::1]:10256", "192.0.2.1:10256", "[::1]:10256"] {
        let mut answer = None;
        for _ in 0..50 {
            if let Ok(a) = http_get(ext_or_node(&node, &ext, addr), sa(addr), "/livez") {
                answer = Some(a);
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let (code, _) =
            answer.unwrap_or_else(|| panic!("no answer on {addr}: {:#?}", agent.stderr()));
        assert_eq!(code, 200, "{addr}");
    }
}

/// Loopback is asked from the node itself, the node's addresses from the external host.
fn ext_or_node<'a>(node: &'a Ns, ext: &'a Ns, addr: &str) -> &'a Ns {
    if addr.starts_with("[::1]") { node } else { ext }
}
