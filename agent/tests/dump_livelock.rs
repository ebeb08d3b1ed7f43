//! Reading table `nftproxy` back while other programs commit to nf_tables. Needs root: each
//! test makes its own network namespace (`nftp-livelock-<pid>-<n>`), programs a cluster there
//! with the agent's own `Syncer`, and runs a thread inside it as the other program, committing
//! over its own netlink socket.
//! Nothing outside the namespace is touched.
//!
//! Every commit, to any table of the namespace, flags each dump running across it as
//! interrupted. A program committing to its own table every millisecond used to make a read
//! of a large table fail (five interrupted attempts in a row); now such commits do not
//! disturb it, and commits to nftproxy's own table make it start again after a short backoff.
//! Figures are printed (`--nocapture`); `NFTP_SERVICES` changes the table size (10,000).

use std::io::Write;
use std::net::{IpAddr, Ipv4Addr};
use std::os::fd::AsRawFd;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use dataplane::convert::{self, Objects};
use dataplane::model::Cluster;
use dataplane::nft::build::{BuildConfig, LocalDetector};
use dataplane::nft::ruleset::{Family, Key};
use dataplane::nft::state::{Elements, TableState};
use netlink_sys::{Socket, protocols::NETLINK_NETFILTER};
use nftproxy::nftables::{Nftables, ReadStats};
use nftproxy::proxier::Syncer;
use serde_json::{Value, json};

mod common;
use common::Netns;

const NODE: &str = "test-node";

fn v4(base: [u8; 4], offset: usize) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(Ipv4Addr::from(base)) + offset as u32)
}

/// Service `i`: ClusterIP (70%), NodePort (20%) or LoadBalancer (10%, half of them with
/// `externalTrafficPolicy: Local`); 2 endpoints, 20 for every 50th (a Service chain), session
/// affinity for every 100th (endpoint chains).
fn service_objects(i: usize) -> [Value; 2] {
    let endpoints = if i.is_multiple_of(50) { 20 } else { 2 };
    let kind = match i % 10 {
        0..=6 => "ClusterIP",
        7 | 8 => "NodePort",
        _ => "LoadBalancer",
    };
    let name = format!("svc-{i}");
    let namespace = format!("ns-{}", i / 100);
    let mut port = json!({"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080});
    if kind != "ClusterIP" {
        port["nodePort"] = json!(30000 + i % 30000);
    }
    let mut spec = json!({
        "type": kind,
        "clusterIP": v4([172, 16, 0, 10], i).to_string(),
        "ports": [port],
    });
    if kind == "LoadBalancer" && i % 20 == 9 {
        spec["externalTrafficPolicy"] = json!("Local");
        spec["healthCheckNodePort"] = json!(40000 + i % 20000);
    }
    if i % 100 == 1 {
        spec["sessionAffinity"] = json!("ClientIP");
    }
    let mut svc = json!({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": namespace},
        "spec": spec,
    });
    if kind == "LoadBalancer" {
        svc["status"] =
            json!({"loadBalancer": {"ingress": [{"ip": v4([198, 18, 0, 1], i).to_string()}]}});
    }
    let eps: Vec<Value> = (0..endpoints)
        .map(|j| {
            json!({
                "addresses": [v4([10, 64, 0, 0], i * 20 + j).to_string()],
                "conditions": {"ready": true},
                "nodeName": if j == 0 && i.is_multiple_of(3) { NODE.to_string() } else { format!("node-{}", (i + j) % 50) },
            })
        })
        .collect();
    let slice = json!({
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": format!("{name}-a"),
            "namespace": namespace,
            "labels": {"kubernetes.io/service-name": name},
        },
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
        "endpoints": eps,
    });
    [svc, slice]
}

fn cluster(services: usize) -> Cluster {
    let mut objects = Objects::default();
    objects.nodes.push(
        serde_json::from_value(json!({
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": NODE},
            "status": {"addresses": [{"type": "InternalIP", "address": "192.168.0.2"}]},
        }))
        .unwrap(),
    );
    for i in 0..services {
        let [svc, slice] = service_objects(i);
        objects.services.push(serde_json::from_value(svc).unwrap());
        objects.slices.push(serde_json::from_value(slice).unwrap());
    }
    let (cluster, skipped) = convert::cluster(&objects, NODE, "");
    assert!(skipped.is_empty(), "{skipped:?}");
    cluster
}

fn config() -> BuildConfig {
    BuildConfig {
        node_name: NODE.to_string(),
        local_detector: LocalDetector::ClusterCidr(vec!["10.0.0.0/8".parse().unwrap()]),
        ..BuildConfig::default()
    }
}

fn services() -> usize {
    std::env::var("NFTP_SERVICES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10_000)
}

/// Programs `cluster` in the namespace with the agent's own syncer; returns a handle opened
/// there, for reading.
fn program(ns: &Netns, cluster: Cluster) -> Nftables {
    ns.run(move || {
        let mut syncer = Syncer::new().expect("syncer");
        let started = Instant::now();
        syncer
            .sync(&cluster, &config(), true)
            .expect("sync the cluster");
        eprintln!(
            "programmed {} Services in {:?}",
            cluster.services.len(),
            started.elapsed()
        );
        Nftables::open().expect("open netlink socket")
    })
}

// --- The other program: a thread committing over its own netlink socket. ---

const NLA_F_NESTED: u16 = 0x8000;
const NFNL_SUBSYS_NFTABLES: u16 = 10;
const NFT_MSG_NEWCHAIN: u16 = 3;
const NFT_MSG_DELCHAIN: u16 = 5;
const NFT_MSG_NEWSETELEM: u16 = 12;
const NFT_MSG_DELSETELEM: u16 = 14;

fn attr(kind: u16, payload: &[u8]) -> Vec<u8> {
    let mut a = Vec::new();
    a.extend(((4 + payload.len()) as u16).to_ne_bytes());
    a.extend(kind.to_ne_bytes());
    a.extend(payload);
    while a.len() % 4 != 0 {
        a.push(0);
    }
    a
}

fn c_str(s: &str) -> Vec<u8> {
    [s.as_bytes(), &[0]].concat()
}

/// A netlink message with an nfgenmsg header.
fn message(out: &mut Vec<u8>, kind: u16, flags: u16, seq: u32, family: u8, attrs: &[u8]) {
    out.extend(((20 + attrs.len()) as u32).to_ne_bytes());
    out.extend(kind.to_ne_bytes());
    out.extend(flags.to_ne_bytes());
    out.extend(seq.to_ne_bytes());
    out.extend(0u32.to_ne_bytes());
    out.push(family);
    out.push(0);
    out.extend(NFNL_SUBSYS_NFTABLES.to_be_bytes());
    out.extend(attrs);
}

/// One nf_tables command: message type (`NFT_MSG_*`), IPv4 family, attributes.
type Cmd = (u16, Vec<u8>);

/// Adds (`add`) or deletes IPv4 element `addr` of set `set` in table `table`.
fn element(add: bool, table: &str, set: &str, addr: Ipv4Addr) -> Cmd {
    let key = attr(1 | NLA_F_NESTED, &attr(1, &addr.octets()));
    let elem = attr(1 | NLA_F_NESTED, &key);
    let attrs = [
        attr(1, &c_str(table)),
        attr(2, &c_str(set)),
        attr(3 | NLA_F_NESTED, &elem),
    ]
    .concat();
    let kind = if add {
        NFT_MSG_NEWSETELEM
    } else {
        NFT_MSG_DELSETELEM
    };
    (kind, attrs)
}

/// Adds or deletes regular chain `name` of table `table`.
fn chain(add: bool, table: &str, name: &str) -> Cmd {
    let attrs = [attr(1, &c_str(table)), attr(3, &c_str(name))].concat();
    (
        if add {
            NFT_MSG_NEWCHAIN
        } else {
            NFT_MSG_DELCHAIN
        },
        attrs,
    )
}

/// A thread in the namespace committing `command(i)` (one transaction each) every `period`;
/// stopped on drop.
struct Writer {
    stop: Arc<AtomicBool>,
    committed: Arc<AtomicU64>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Writer {
    fn start(
        ns: &Netns,
        period: Duration,
        command: impl Fn(u64) -> Cmd + Send + 'static,
    ) -> Writer {
        let stop = Arc::new(AtomicBool::new(false));
        let committed = Arc::new(AtomicU64::new(0));
        let path = format!("/run/netns/{}", ns.name);
        let thread = {
            let (stop, committed) = (stop.clone(), committed.clone());
            std::thread::spawn(move || {
                let file = std::fs::File::open(&path).expect("open netns file");
                // SAFETY: setns on this thread only, with a namespace fd we hold open.
                let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
                assert_eq!(rc, 0, "setns: {}", std::io::Error::last_os_error());
                let mut sock = Socket::new(NETLINK_NETFILTER).expect("netlink socket");
                sock.bind_auto().expect("bind");
                let mut reply = vec![0u8; 1 << 16];
                let mut next = Instant::now();
                let mut i = 0u64;
                let mut seq = 1u32;
                while !stop.load(Ordering::Relaxed) {
                    let (kind, attrs) = command(i);
                    let mut batch = Vec::new();
                    message(&mut batch, 0x10, 1, seq, 0, &[]); // NFNL_MSG_BATCH_BEGIN
                    let ack = 1 | 4 | 0x400; // NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE
                    message(
                        &mut batch,
                        (NFNL_SUBSYS_NFTABLES << 8) | kind,
                        ack,
                        seq + 1,
                        2,
                        &attrs,
                    );
                    message(&mut batch, 0x11, 1, seq + 2, 0, &[]); // NFNL_MSG_BATCH_END
                    seq += 3;
                    sock.send(&batch, 0).expect("send a batch");
                    // The ACK (or error) of the command.
                    let n = sock.recv(&mut &mut reply[..], 0).expect("read the ACK");
                    let errno = i32::from_ne_bytes(reply[16..20].try_into().unwrap());
                    assert!(n >= 20 && errno == 0, "commit {i} failed: errno {}", -errno);
                    i += 1;
                    committed.store(i, Ordering::Relaxed);
                    next += period;
                    if let Some(wait) = next.checked_duration_since(Instant::now()) {
                        std::thread::sleep(wait);
                    }
                }
            })
        };
        Writer {
            stop,
            committed,
            thread: Some(thread),
        }
    }

    /// Stops the writer; its commits so far.
    fn stop(mut self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            t.join().expect("the writer failed");
        }
        self.committed.load(Ordering::Relaxed)
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Reads `n` times: the states, each read's time and stats.
fn reads(nft: &mut Nftables, n: usize) -> Vec<(TableState, Duration, ReadStats)> {
    (0..n)
        .map(|_| {
            let started = Instant::now();
            let state = nft
                .read_table(Family::V4)
                .expect("read_table")
                .expect("the table exists");
            (state, started.elapsed(), nft.last_read())
        })
        .collect()
}

fn median(mut d: Vec<Duration>) -> Duration {
    d.sort();
    d[d.len() / 2]
}

/// Commits per millisecond the writer achieved while `f` ran (from the ruleset generation).
fn with_generation_rate<T>(nft: &mut Nftables, f: impl FnOnce(&mut Nftables) -> T) -> (T, f64) {
    let g0 = nft.generation().unwrap();
    let started = Instant::now();
    let out = f(nft);
    let g1 = nft.generation().unwrap();
    let ms = started.elapsed().as_secs_f64() * 1000.0;
    (out, f64::from(g1.wrapping_sub(g0)) / ms)
}

#[test]
fn a_large_table_reads_back_while_another_table_changes_every_millisecond() {
    nftproxy_tests::require_root!();
    let ns = Netns::new("livelock");
    let n = services();
    let mut nft = program(&ns, cluster(n));

    // Quietly: the reference, and the time a read takes.
    let quiet = reads(&mut nft, 5);
    let reference = quiet[0].0.clone();
    assert!(
        quiet
            .iter()
            .all(|(s, _, st)| *s == reference && st.attempts == 1),
        "quiet reads differ"
    );
    let elements: usize = reference
        .sets
        .values()
        .filter_map(|s| s.elements.read())
        .map(|e| e.len())
        .sum();
    let quiet_median = median(quiet.iter().map(|r| r.1).collect());

    // Another program adds and deletes an element of its own table every millisecond.
    ns.exec(&[
        "nft",
        "add table ip other; add set ip other s { type ipv4_addr; }; add chain ip other c",
    ]);
    let writer = Writer::start(&ns, Duration::from_millis(1), |i| {
        let addr = Ipv4Addr::from(0x0a63_0000 + (i / 2) as u32 % 60_000);
        element(i % 2 == 0, "other", "s", addr)
    });
    std::thread::sleep(Duration::from_millis(200));
    let (busy, rate) = with_generation_rate(&mut nft, |nft| reads(nft, 5));
    let sent = writer.stop();
    for (i, (state, took, stats)) in busy.iter().enumerate() {
        eprintln!("busy read {i}: {took:?} {stats:?}");
        assert!(*state == reference, "read {i} differs from the table");
    }
    assert!(
        rate > 0.3,
        "the other program committed only {rate:.2} times per ms"
    );
    assert!(
        busy.iter().map(|r| r.2.foreign_commits).sum::<u32>() > 0,
        "no commit happened during the reads"
    );
    let busy_median = median(busy.iter().map(|r| r.1).collect());

    // And the table is still what it was.
    assert!(reads(&mut nft, 1)[0].0 == reference);
    eprintln!(
        "{n} Services ({} chains, {} sets, {elements} elements): quiet read median {quiet_median:?} \
         (all: {:?}); while another table changed {rate:.2} times per ms ({sent} commits): \
         median {busy_median:?}, attempts {:?}, interrupted dumps kept {:?}, chain dump \
         retries {:?}, foreign commits during the read {:?}",
        reference.chains.len(),
        reference.sets.len(),
        quiet.iter().map(|r| r.1).collect::<Vec<_>>(),
        busy.iter().map(|r| r.2.attempts).collect::<Vec<_>>(),
        busy.iter()
            .map(|r| r.2.interrupted_dumps)
            .collect::<Vec<_>>(),
        busy.iter()
            .map(|r| r.2.chain_dump_retries)
            .collect::<Vec<_>>(),
        busy.iter().map(|r| r.2.foreign_commits).collect::<Vec<_>>(),
    );
}

#[test]
fn chains_added_and_deleted_elsewhere_do_not_disturb_the_read() {
    nftproxy_tests::require_root!();
    // Another ip table whose chains come and go: the chain dump, which the kernel does not
    // filter by table, is the one that could skip or repeat ours.
    let ns = Netns::new("livelock");
    let mut nft = program(&ns, cluster(2_000));
    let reference = reads(&mut nft, 1).remove(0).0;
    // Put the other table's chains before ours in the kernel's list.
    let (ok, _, err) = ns.try_exec(&["nft", "add table ip aaa"]);
    assert!(ok, "{err}");
    let script: String = (0..3000)
        .map(|i| format!("add chain ip aaa c{i}\n"))
        .collect();
    let mut child = Command::new("ip")
        .args(["netns", "exec", &ns.name, "nft", "-f", "-"])
        .stdin(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(script.as_bytes())
        .unwrap();
    assert!(child.wait().unwrap().success());
    let writer = Writer::start(&ns, Duration::from_millis(1), |i| {
        chain(i % 2 == 0, "aaa", &format!("moving{}", i / 2))
    });
    std::thread::sleep(Duration::from_millis(100));
    let busy = reads(&mut nft, 10);
    let commits = writer.stop();
    assert!(commits > 100, "only {commits} commits");
    for (i, (state, took, stats)) in busy.iter().enumerate() {
        eprintln!("read {i}: {took:?} {stats:?}");
        assert!(*state == reference, "read {i} differs from the table");
    }
    assert!(
        busy.iter().any(|r| r.2.chain_dump_retries > 0),
        "no chain dump was run again: the test did not exercise what it is for"
    );
}

#[test]
fn commits_to_our_own_table_make_the_read_start_again() {
    nftproxy_tests::require_root!();
    let ns = Netns::new("livelock");
    let mut nft = program(&ns, cluster(200));
    let quiet = reads(&mut nft, 5);
    let reference = quiet[0].0.clone();
    let stray: IpAddr = "172.31.9.9".parse().unwrap();
    // Someone toggles an element of our `cluster-ips` set, every three reads' time: a read
    // often overlaps a change (and starts again) but has room to finish.
    let period = (median(quiet.iter().map(|r| r.1).collect()) * 3).max(Duration::from_millis(2));
    let IpAddr::V4(stray4) = stray else {
        unreachable!()
    };
    let writer = Writer::start(&ns, period, move |i| {
        element(i % 2 == 0, "nftproxy", "cluster-ips", stray4)
    });
    std::thread::sleep(Duration::from_millis(20));
    let busy = reads(&mut nft, 20);
    writer.stop();
    let mut retried = 0;
    for (i, (state, took, stats)) in busy.iter().enumerate() {
        // Either with or without the element, never anything else.
        let mut state = state.clone();
        if let Some(set) = state.sets.get_mut("cluster-ips")
            && let Elements::Read(elements) = &mut set.elements
        {
            elements.remove(&Key::Addr(stray));
        }
        assert!(
            state == reference,
            "read {i} is neither state ({took:?} {stats:?})"
        );
        retried += usize::from(stats.attempts > 1);
    }
    eprintln!(
        "200 Services, our own table changed every {period:?}: read times {:?}, attempts {:?}",
        busy.iter().map(|r| r.1).collect::<Vec<_>>(),
        busy.iter().map(|r| r.2.attempts).collect::<Vec<_>>()
    );
    assert!(retried > 0, "no read noticed the changes to its table");
}
