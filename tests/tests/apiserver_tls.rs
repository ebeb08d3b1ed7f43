//! The in-memory API server in its real-cluster shape: HTTPS with a cluster CA and a
//! required ServiceAccount token, bound to a chosen address in a control-plane namespace
//! that the client reaches over a veth (also through a ClusterIP DNAT), and the injected
//! faults (slow lists, failing resources). Needs root.

use std::future::Future;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::Result;
use futures_util::StreamExt;
use k8s_openapi::api::core::v1::{Node, Service};
use kube::api::{Api, ListParams, WatchParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::runtime::watcher::{self, Event, watcher};
use kube::{Client, Config, ResourceExt};
use nftproxy_tests::apiserver::{SERVICE_ACCOUNT_DIR, in_netns, kubeadm_kubeconfig};
use nftproxy_tests::{ApiServer, Lab, Ns, ip};
use serde_json::{Value, json};

const API_IP: &str = "192.0.2.1";
const API_IP6: &str = "2001:db8::1";
const CLUSTER_IP: &str = "10.96.0.1";

/// A node, and a control-plane namespace on an uplink of it holding [`API_IP`] and
/// [`API_IP6`], where the server runs.
struct Env {
    _lab: Lab,
    node: Ns,
    cp: Ns,
}

fn env() -> Env {
    assert!(
        nftproxy_tests::privilege::is_root(),
        "the namespace tests need root"
    );
    let lab = Lab::with_nettest(env!("CARGO_BIN_EXE_nettest")).unwrap();
    let node = lab.node("node").unwrap();
    let cp = lab
        .external(
            &node,
            "cp",
            &[ip(API_IP), ip(API_IP6)],
            &[ip("192.0.2.254"), ip("2001:db8::fe")],
        )
        .unwrap();
    Env {
        _lab: lab,
        node,
        cp,
    }
}

/// A TLS server on `API_IP:6443` in the control-plane namespace, like kubeadm's.
fn tls_server(env: &Env) -> ApiServer {
    ApiServer::builder()
        .netns(env.cp.name())
        .bind(ip(API_IP))
        .port(6443)
        .tls(true)
        .san(ip(CLUSTER_IP))
        .start()
        .unwrap()
}

fn svc(name: &str) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"clusterIP": "172.30.0.10", "ports": [{"port": 80, "protocol": "TCP"}]},
    })
}

fn node_obj(name: &str) -> Value {
    json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}})
}

async fn config_from(kubeconfig: &Path) -> Result<Config> {
    let kubeconfig = Kubeconfig::read_from(kubeconfig)?;
    Ok(Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default()).await?)
}

/// Runs `f` with the config of `kubeconfig` on a thread inside the node namespace.
fn on_node<F, Fut>(env: &Env, kubeconfig: &Path, f: F)
where
    F: FnOnce(Config) -> Fut + Send,
    Fut: Future<Output = Result<()>>,
{
    in_netns(env.node.name(), || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        rt.block_on(async { f(config_from(kubeconfig).await?).await })
    })
    .unwrap()
    .unwrap();
}

fn names<K: ResourceExt>(objs: &[K]) -> Vec<String> {
    objs.iter().map(|o| o.name_any()).collect()
}

/// The status code of a kube API error (`None` for any other error).
fn api_code<T: std::fmt::Debug>(r: kube::Result<T>) -> Option<u16> {
    match r {
        Err(kube::Error::Api(s)) => Some(s.code),
        other => {
            eprintln!("not an API error: {other:?}");
            None
        }
    }
}

#[test]
fn tls_with_token_lists_and_watches() {
    nftproxy_tests::require_root!();
    let env = env();
    let api = &tls_server(&env);
    assert_eq!(api.url(), format!("https://{API_IP}:6443"));
    let kubeconfig = std::fs::read_to_string(api.kubeconfig()).unwrap();
    assert!(!kubeconfig.contains("insecure"), "{kubeconfig}");
    assert!(
        kubeconfig.contains("certificate-authority:"),
        "{kubeconfig}"
    );
    assert!(kubeconfig.contains("tokenFile:"), "{kubeconfig}");
    api.apply(svc("a")).unwrap();

    on_node(&env, &api.kubeconfig(), |config| async move {
        let services: Api<Service> = Api::all(Client::try_from(config)?);
        assert_eq!(
            names(&services.list(&ListParams::default()).await?.items),
            ["a"]
        );
        let mut events = watcher(services, watcher::Config::default()).boxed();
        let mut next = async || -> Result<String> {
            let e = tokio::time::timeout(Duration::from_secs(5), events.next()).await;
            match e.expect("a watcher event in 5 s").expect("no end")? {
                Event::Init => Ok("Init".to_string()),
                Event::InitApply(s) => Ok(format!("InitApply({})", s.name_any())),
                Event::InitDone => Ok("InitDone".to_string()),
                Event::Apply(s) => Ok(format!("Apply({})", s.name_any())),
                Event::Delete(s) => Ok(format!("Delete({})", s.name_any())),
            }
        };
        for want in ["Init", "InitApply(a)", "InitDone"] {
            assert_eq!(next().await?, want);
        }
        api.apply(svc("b"))?;
        assert_eq!(next().await?, "Apply(b)");
        anyhow::Ok(())
    });

    // Every request carried the token.
    let log = api.requests();
    assert!(log.iter().any(|r| r.is_watch()), "{log:#?}");
    assert!(log.iter().all(|r| r.status == Some(200)), "{log:#?}");
}

#[test]
fn requests_without_the_token_get_401() {
    nftproxy_tests::require_root!();
    let env = env();
    let api = &tls_server(&env);
    on_node(&env, &api.kubeconfig(), |config| async move {
        let mut anonymous = config.clone();
        anonymous.auth_info = Default::default();
        let services: Api<Service> = Api::all(Client::try_from(anonymous)?);
        match services.list(&ListParams::default()).await {
            Err(kube::Error::Api(s)) => {
                assert_eq!((s.code, s.reason.as_str()), (401, "Unauthorized"));
                assert_eq!(s.message, "Unauthorized");
            }
            other => panic!("not a 401: {other:?}"),
        }
        let mut wrong = config;
        wrong.auth_info = Default::default();
        wrong.auth_info.token = Some("not-the-token".to_string().into());
        let nodes: Api<Node> = Api::all(Client::try_from(wrong)?);
        assert_eq!(
            api_code(nodes.list(&ListParams::default()).await),
            Some(401)
        );
        Ok(())
    });
    let log = api.requests();
    assert_eq!(log.len(), 2, "{log:#?}");
    assert!(log.iter().all(|r| r.status == Some(401)), "{log:#?}");
}

#[test]
fn a_client_that_does_not_trust_the_ca_fails() {
    nftproxy_tests::require_root!();
    let env = env();
    let api = &tls_server(&env);
    // Another cluster's CA (same addresses, different key).
    let other = ApiServer::builder()
        .netns(env.cp.name())
        .bind(ip(API_IP))
        .tls(true)
        .start()
        .unwrap();
    assert_ne!(api.ca_pem(), other.ca_pem());
    let dir = tempfile::tempdir().unwrap();
    let wrong_ca = dir.path().join("kubeconfig");
    let token = api.service_account_dir().join("token");
    api.write_kubeconfig(
        &wrong_ca,
        &other.service_account_dir().join("ca.crt"),
        &token,
    )
    .unwrap();
    on_node(&env, &wrong_ca, |config| async move {
        let services: Api<Service> = Api::all(Client::try_from(config)?);
        let err = services.list(&ListParams::default()).await.unwrap_err();
        // Signed by a key it does not trust.
        assert!(format!("{err:?}").contains("InvalidCertificate"), "{err:?}");
        Ok(())
    });
    assert!(api.requests().is_empty(), "{:#?}", api.requests());
}

#[test]
fn service_account_files_and_a_kubeadm_kubeconfig() {
    nftproxy_tests::require_root!();
    let env = env();
    let api = &tls_server(&env);
    let sa = api.service_account_dir().to_path_buf();
    let read = |f: &str| std::fs::read_to_string(sa.join(f)).unwrap();
    assert_eq!(read("token"), api.token());
    assert_eq!(read("namespace"), "kube-system");
    assert_eq!(Some(read("ca.crt").as_str()), api.ca_pem());
    assert!(read("ca.crt").starts_with("-----BEGIN CERTIFICATE-----"));

    // As mounted in a pod: the kubeconfig only names the ServiceAccount paths.
    let dir = tempfile::tempdir().unwrap();
    let in_pod = dir.path().join("in-pod.conf");
    let sa_path = Path::new(SERVICE_ACCOUNT_DIR);
    api.write_kubeconfig(&in_pod, &sa_path.join("ca.crt"), &sa_path.join("token"))
        .unwrap();
    let text = std::fs::read_to_string(&in_pod).unwrap();
    assert!(
        text.contains(&format!("server: https://{API_IP}:6443")),
        "{text}"
    );
    assert!(
        text.contains(
            "certificate-authority: /var/run/secrets/kubernetes.io/serviceaccount/ca.crt"
        ),
        "{text}"
    );
    assert!(
        text.contains("tokenFile: /var/run/secrets/kubernetes.io/serviceaccount/token"),
        "{text}"
    );

    // The same shape pointing at the server's dir works, also through the `kubernetes`
    // Service's ClusterIP (which the certificate covers) DNATed to the server.
    let direct = dir.path().join("direct.conf");
    api.write_kubeconfig(&direct, &sa.join("ca.crt"), &sa.join("token"))
        .unwrap();
    let via_vip = dir.path().join("vip.conf");
    let text = kubeadm_kubeconfig(
        &format!("https://{CLUSTER_IP}:443"),
        &sa.join("ca.crt"),
        &sa.join("token"),
    );
    std::fs::write(&via_vip, text).unwrap();
    let uplink = env.cp.node_link().unwrap();
    env.node
        .add_route(&format!("{CLUSTER_IP}/32 dev {uplink}"))
        .unwrap();
    env.node
        .nft(&format!(
            "table ip vip {{
                chain out {{
                    type nat hook output priority -100;
                    ip daddr {CLUSTER_IP} tcp dport 443 dnat to {API_IP}:6443
                }}
            }}"
        ))
        .unwrap();
    api.apply(svc("a")).unwrap();
    for kubeconfig in [direct, via_vip] {
        on_node(&env, &kubeconfig, |config| async move {
            let services: Api<Service> = Api::all(Client::try_from(config)?);
            assert_eq!(
                names(&services.list(&ListParams::default()).await?.items),
                ["a"]
            );
            Ok(())
        });
    }
    assert_eq!(api.requests().len(), 2, "{:#?}", api.requests());
}

#[test]
fn tls_on_ipv6_and_plain_http_on_a_chosen_port() {
    nftproxy_tests::require_root!();
    let env = env();
    let tls6 = ApiServer::builder()
        .netns(env.cp.name())
        .bind(ip(API_IP6))
        .port(6443)
        .tls(true)
        .start()
        .unwrap();
    assert_eq!(tls6.url(), format!("https://[{API_IP6}]:6443"));
    let plain = ApiServer::builder()
        .netns(env.cp.name())
        .bind(ip(API_IP))
        .port(8080)
        .start()
        .unwrap();
    assert_eq!(plain.url(), format!("http://{API_IP}:8080"));
    assert_eq!(plain.ca_pem(), None);
    for api in [&tls6, &plain] {
        api.apply(node_obj("n1")).unwrap();
        on_node(&env, &api.kubeconfig(), |config| async move {
            let nodes: Api<Node> = Api::all(Client::try_from(config)?);
            assert_eq!(
                names(&nodes.list(&ListParams::default()).await?.items),
                ["n1"]
            );
            Ok(())
        });
    }
}

#[test]
fn list_delay_answers_late_with_the_state_then() {
    nftproxy_tests::require_root!();
    let env = env();
    let api = &tls_server(&env);
    api.apply(svc("a")).unwrap();
    api.set_list_delay(Duration::from_millis(1500));
    on_node(&env, &api.kubeconfig(), |config| async move {
        let services: Api<Service> = Api::all(Client::try_from(config)?);
        let start = Instant::now();
        let lp = ListParams::default();
        let list = services.list(&lp);
        let write = async {
            tokio::time::sleep(Duration::from_millis(300)).await;
            api.apply(svc("b"))
        };
        let (list, write) = tokio::join!(list, write);
        write?;
        let took = start.elapsed();
        assert!(took >= Duration::from_millis(1500), "{took:?}");
        assert!(took < Duration::from_secs(4), "{took:?}");
        assert_eq!(names(&list?.items), ["a", "b"]);

        // Watches are not delayed.
        let start = Instant::now();
        let _stream = services
            .watch(&WatchParams::default().timeout(1), "0")
            .await?;
        assert!(start.elapsed() < Duration::from_millis(1000));

        api.set_list_delay(Duration::ZERO);
        let start = Instant::now();
        services.list(&ListParams::default()).await?;
        assert!(start.elapsed() < Duration::from_millis(1000));
        Ok(())
    });
    let log = api.requests();
    let first = &log[0];
    assert!(!first.is_watch() && first.status == Some(200), "{log:#?}");
    let took = first.answered.unwrap() - first.at;
    assert!(took >= Duration::from_millis(1500), "{took:?}");
}

#[test]
fn failing_resources_get_their_status() {
    nftproxy_tests::require_root!();
    let env = env();
    let api = &tls_server(&env);
    api.apply(node_obj("n1")).unwrap();
    api.apply(svc("a")).unwrap();
    api.set_fail("nodes", Some(500));
    on_node(&env, &api.kubeconfig(), |config| async move {
        let client = Client::try_from(config)?;
        let nodes: Api<Node> = Api::all(client.clone());
        let services: Api<Service> = Api::all(client);
        match nodes.list(&ListParams::default()).await {
            Err(kube::Error::Api(s)) => {
                assert_eq!((s.code, s.reason.as_str()), (500, "InternalError"))
            }
            other => panic!("not a 500: {other:?}"),
        }
        let watch = nodes.watch(&WatchParams::default(), "0").await;
        assert_eq!(api_code(watch.map(|_| ())), Some(500));
        assert_eq!(
            names(&services.list(&ListParams::default()).await?.items),
            ["a"]
        );

        api.set_fail("Node", Some(403));
        match nodes.list(&ListParams::default()).await {
            Err(kube::Error::Api(s)) => {
                assert_eq!((s.code, s.reason.as_str()), (403, "Forbidden"));
                assert!(
                    s.message.contains("cannot list resource \"nodes\""),
                    "{}",
                    s.message
                );
            }
            other => panic!("not a 403: {other:?}"),
        }

        api.set_fail("nodes", None);
        assert_eq!(
            names(&nodes.list(&ListParams::default()).await?.items),
            ["n1"]
        );
        Ok(())
    });
    let statuses: Vec<(String, Option<u16>)> = api
        .requests()
        .iter()
        .map(|r| (r.path().to_string(), r.status))
        .collect();
    assert_eq!(
        statuses,
        [
            ("/api/v1/nodes".to_string(), Some(500)),
            ("/api/v1/nodes".to_string(), Some(500)),
            ("/api/v1/services".to_string(), Some(200)),
            ("/api/v1/nodes".to_string(), Some(403)),
            ("/api/v1/nodes".to_string(), Some(200)),
        ]
    );
}
