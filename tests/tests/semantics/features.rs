//! The semantics around the tables: session affinity, protocols and ports,
//! `service-proxy-name`, masquerade and detect-local modes, hairpin.

use super::*;

// ------------------------------------------------------------------------------------------
// Session affinity

/// The single endpoint every attempt reached, or why not.
pub(super) fn one_endpoint(attempts: &[Attempt]) -> Result<SocketAddr, String> {
    let set: BTreeSet<SocketAddr> = attempts
        .iter()
        .filter_map(|a| match a {
            Attempt::Answered { local, .. } => Some(*local),
            _ => None,
        })
        .collect();
    match (set.len(), attempts.len()) {
        (1, n)
            if attempts
                .iter()
                .all(|a| matches!(a, Attempt::Answered { .. }))
                && n > 0 =>
        {
            Ok(*set.first().unwrap())
        }
        _ => Err(format!("{attempts:?}")),
    }
}

pub(super) fn session_affinity(mode: Mode) {
    const CLIENTS: u8 = 12;
    let mut w = world(
        mode,
        Opts {
            extra_clients: CLIENTS - 1,
            ..Opts::default()
        },
    );
    let three = || {
        [
            ep("10.0.1.1").node(NODE_NAME),
            ep("10.0.1.2").node("node1"),
            ep("10.0.1.3").node("node2"),
        ]
    };
    let objects = base_objects()
        .with(
            Service::new("ns1", "aff", "172.30.0.60")
                .node_port_type()
                .external_ips(&[NODE_EXTERNAL_IP])
                .port("http", Proto::Tcp, 80)
                .node_port(3001)
                .client_ip_affinity(3),
        )
        .with(
            Slice::new("ns1", "aff-a", "aff")
                .port("http", Proto::Tcp, 80)
                .endpoints(three()),
        )
        .with(Service::new("ns1", "noaff", "172.30.0.61").port("http", Proto::Tcp, 80))
        .with(
            Slice::new("ns1", "noaff-a", "noaff")
                .port("http", Proto::Tcp, 80)
                .endpoints(three()),
        );
    w.apply("affinity", &objects, &base_config());
    let all: BTreeSet<SocketAddr> = ["10.0.1.1:80", "10.0.1.2:80", "10.0.1.3:80"]
        .iter()
        .map(|s| sa(s))
        .collect();
    // The tracer knows nothing of the run-time affinity sets: a first connection may go to
    // any endpoint.
    if mode == Mode::Nftables {
        let (fate, _) = w.tracer(&tcp("", POD, "172.30.0.60:80", "", false));
        assert_eq!(
            fate,
            Fate::Endpoints {
                set: all.clone(),
                masq: false
            }
        );
    }
    let clients: Vec<IpAddr> = (0..CLIENTS)
        .map(|i| IpAddr::from([10, 0, 0, 2 + i]))
        .collect();
    let cip = sa("172.30.0.60:80");
    let vips = [cip, sa("192.168.99.11:80"), sa("192.168.0.2:3001")];
    let probe = |src: IpAddr, dst: SocketAddr, count: usize, parallel: usize| {
        let mut p = Probe::new(Proto::Tcp, dst, count)
            .src(src)
            .parallel(parallel)
            .timeout(ANSWER_TIMEOUT);
        p.count = count;
        w.attempts(&w.pod, &p)
    };
    // One round: for each client and each address of the port, the first connection alone
    // (it creates the affinity entry; racing first connections could each pick an endpoint),
    // then more. nftproxy remembers a client per destination (docs/architecture.md, "Session
    // affinity"): the ClusterIP, the external IP and the NodePort each keep it on one endpoint.
    type Round = BTreeMap<(IpAddr, SocketAddr), Result<SocketAddr, String>>;
    let round = |per_vip: usize| -> Round {
        std::thread::scope(|s| {
            let handles: Vec<_> = clients
                .iter()
                .map(|&c| {
                    s.spawn(move || {
                        vips.map(|vip| {
                            let mut attempts = probe(c, vip, 1, 1);
                            attempts.extend(probe(c, vip, per_vip, 8));
                            ((c, vip), one_endpoint(&attempts))
                        })
                    })
                })
                .collect();
            handles
                .into_iter()
                .flat_map(|h| h.join().unwrap())
                .collect()
        })
    };
    // 50 connections from one client all reach one endpoint.
    let mut first = probe(clients[0], cip, 1, 1);
    first.extend(probe(clients[0], cip, 49, 8));
    if let Err(e) = one_endpoint(&first) {
        w.fail(format!("50 connections from {} spread: {e}", clients[0]));
    }
    let before = round(6);
    let done = Instant::now();
    // Without affinity the same client spreads.
    let spread = probe(clients[0], sa("172.30.0.61:80"), 50, 8);
    let seen: BTreeSet<SocketAddr> = spread
        .iter()
        .filter_map(|a| match a {
            Attempt::Answered { local, .. } => Some(*local),
            _ => None,
        })
        .collect();
    if seen.len() < 2 || !seen.is_subset(&all) {
        w.fail(format!("without affinity, 50 connections reached {seen:?}"));
    }
    // Past the timeout, each client chooses again.
    std::thread::sleep(Duration::from_millis(3600).saturating_sub(done.elapsed()));
    let after = round(4);
    let mut changed = 0;
    let mut chosen = BTreeSet::new();
    for (key @ (c, vip), was) in &before {
        match (was, &after[key]) {
            (Ok(a), Ok(b)) => {
                changed += usize::from(a != b);
                chosen.insert(*a);
                chosen.insert(*b);
                if !all.contains(a) || !all.contains(b) {
                    w.fail(format!("{c} to {vip} reached {a} / {b}, not an endpoint"));
                }
            }
            (a, b) => w.fail(format!(
                "{c}: {vip} did not keep the client on one endpoint: {a:?} / {b:?}"
            )),
        }
    }
    // 12 clients × 3 addresses, 2 rounds: all choices equal or no change is next to impossible.
    if chosen.len() < 2 {
        w.fail(format!("all clients chose {chosen:?}"));
    }
    if changed == 0 {
        w.fail("no client chose a new endpoint after the affinity timeout".into());
    }
    w.finish();
}

// ------------------------------------------------------------------------------------------
// Protocols and ports

pub(super) fn mixed_protocol_load_balancer(mode: Mode) {
    let mut w = world(mode, Opts::default());
    let objects = base_objects()
        .with(
            Service::new("ns1", "dns", "172.30.0.70")
                .load_balancer(&[LB2])
                .port("dns-tcp", Proto::Tcp, 53)
                .target_port("5353")
                .node_port(3053)
                .port("dns-udp", Proto::Udp, 53)
                .node_port(3053)
                .port("dns-sctp", Proto::Sctp, 53)
                .node_port(3053),
        )
        .with(
            Slice::new("ns1", "dns-a", "dns")
                .port("dns-tcp", Proto::Tcp, 5353)
                .port("dns-udp", Proto::Udp, 53)
                .port("dns-sctp", Proto::Sctp, 53)
                .endpoint(ep("10.180.0.1").node(NODE_NAME))
                .endpoint(ep("10.180.2.1").node("node2")),
        )
        .with(
            Service::new("ns1", "no-endpoints", "172.30.0.72")
                .port("sctp", Proto::Sctp, 53)
                .port("udp", Proto::Udp, 54),
        );
    w.apply("mixed protocols", &objects, &base_config());
    let both = |p: u16| format!("10.180.0.1:{p}, 10.180.2.1:{p}");
    let (b53, b5353) = (both(53), both(5353));
    use Proto::*;
    #[rustfmt::skip]
    let flows = [
        flow("pod to cluster IP, TCP",     Tcp,  POD,     "172.30.0.70:53",   &b5353, false),
        flow("pod to cluster IP, UDP",     Udp,  POD,     "172.30.0.70:53",   &b53,   false),
        flow("pod to cluster IP, SCTP",    Sctp, POD,     "172.30.0.70:53",   &b53,   false),
        flow("external to LB, TCP",        Tcp,  EXT,     "5.6.7.8:53",       &b5353, true),
        flow("external to LB, UDP",        Udp,  EXT,     "5.6.7.8:53",       &b53,   true),
        flow("external to LB, SCTP",       Sctp, EXT,     "5.6.7.8:53",       &b53,   true),
        flow("external to NodePort, TCP",  Tcp,  EXT,     "192.168.0.2:3053", &b5353, true),
        flow("external to NodePort, UDP",  Udp,  EXT,     "192.168.0.2:3053", &b53,   true),
        flow("external to NodePort, SCTP", Sctp, EXT,     "192.168.0.2:3053", &b53,   true),
        flow("node to LB, UDP",            Udp,  NODE_IP, "5.6.7.8:53",       &b53,   true),
        // A UDP checksum of 0 ("none") survives the address rewrite of a shared list, and a
        // UDP NodePort keeps its own list (a port rewrite would make it wrong).
        flow("external to LB, UDP without checksum",       Udp, EXT, "5.6.7.8:53",       &b53, true)
            .without_udp_checksum(),
        flow("external to NodePort, UDP without checksum", Udp, EXT, "192.168.0.2:3053", &b53, true)
            .without_udp_checksum(),
        flow("node to NodePort, SCTP",     Sctp, NODE_IP, "192.168.0.2:3053", &b53,   true),
        flow("invalid port of a cluster IP", Tcp,  POD, "172.30.0.70:54", "REJECT", false)
            .iptables("DROP", false, NO_WRONG_PORT_REJECT),
        flow("SCTP port without endpoints",  Sctp, POD, "172.30.0.72:53", "REJECT", false),
        flow("UDP port without endpoints",   Udp,  POD, "172.30.0.72:54", "REJECT", false),
        flow("TCP to an SCTP-only port",     Tcp,  POD, "172.30.0.72:53", "REJECT", false)
            .iptables("DROP", false, NO_WRONG_PORT_REJECT),
    ];
    w.check(&flows);
    w.finish();
}

pub(super) fn multiple_ports_and_named_target_port(mode: Mode) {
    let mut w = world(mode, Opts::default());
    let objects = base_objects()
        .with(
            Service::new("ns1", "web", "172.30.0.71")
                .node_port_type()
                .port("http", Proto::Tcp, 80)
                .target_port("web")
                .node_port(3071)
                .port("https", Proto::Tcp, 443)
                .target_port("8443")
                .node_port(3443)
                .port("admin", Proto::Tcp, 8081)
                .target_port("admin")
                .node_port(3081),
        )
        // The EndpointSlice controller resolved "web" to 8080; no pod has an "admin" port.
        .with(
            Slice::new("ns1", "web-a", "web")
                .port("http", Proto::Tcp, 8080)
                .port("https", Proto::Tcp, 8443)
                .endpoint(ep("10.180.0.1").node(NODE_NAME))
                .endpoint(ep("10.180.2.1").node("node2")),
        );
    w.apply("multiple ports", &objects, &base_config());
    let both = |p: u16| format!("10.180.0.1:{p}, 10.180.2.1:{p}");
    let (b8080, b8443) = (both(8080), both(8443));
    #[rustfmt::skip]
    let flows = [
        tcp("named target port",            POD, "172.30.0.71:80",   &b8080,   false),
        tcp("numeric target port",          POD, "172.30.0.71:443",  &b8443,   false),
        tcp("port without endpoints",       POD, "172.30.0.71:8081", "REJECT", false),
        tcp("NodePort of the named port",   EXT, "192.168.0.2:3071", &b8080,   true),
        tcp("NodePort of the numeric port", EXT, "192.168.0.2:3443", &b8443,   true),
        tcp("NodePort without endpoints",   EXT, "192.168.0.2:3081", "REJECT", false),
        tcp("a port the Service lacks",     POD, "172.30.0.71:8080", "REJECT", false)
            .iptables("DROP", false, NO_WRONG_PORT_REJECT),
    ];
    w.check(&flows);
    w.finish();
}

// ------------------------------------------------------------------------------------------
// service.kubernetes.io/service-proxy-name

pub(super) fn services_of_another_proxy_are_not_programmed(mode: Mode) {
    let mut w = world(mode, Opts::default());
    let slice = |svc: &str| {
        Slice::new("ns1", &format!("{svc}-a"), svc)
            .port("p80", Proto::Tcp, 80)
            .endpoint(ep("10.180.0.1").node(NODE_NAME))
    };
    let objects = base_objects()
        .with(
            Service::new("ns1", "theirs", "172.30.0.80")
                .node_port_type()
                .label("service.kubernetes.io/service-proxy-name", "other-proxy")
                .port("p80", Proto::Tcp, 80)
                .node_port(3080),
        )
        .with(slice("theirs"))
        .with(
            Service::new("ns1", "mine", "172.30.0.81")
                .node_port_type()
                .port("p80", Proto::Tcp, 80)
                .node_port(3001),
        )
        .with(slice("mine"));
    w.apply("service-proxy-name", &objects, &base_config());
    let e = "10.180.0.1:80";
    #[rustfmt::skip]
    let flows = [
        // iptables mode does not drop it, but routed on it goes unanswered here just the same.
        tcp("labelled: unallocated cluster IP", POD, "172.30.0.80:80",   "DROP", false)
            .iptables("DROP", false, NO_UNALLOCATED_DROP),
        tcp("labelled: no NodePort",            EXT, "192.168.0.2:3080", "",     false),
        tcp("unlabelled cluster IP",            POD, "172.30.0.81:80",   e,      false),
        tcp("unlabelled NodePort",              EXT, "192.168.0.2:3001", e,      true),
    ];
    w.check(&flows);
    let listing = w.listing();
    for absent in ["172.30.0.80", "theirs", "3080"] {
        if listing.contains(absent) {
            w.fail(format!("{absent} is programmed:\n{listing}"));
        }
    }
    w.finish();
}

// ------------------------------------------------------------------------------------------
// Masquerade and detect-local modes

/// kube-proxy's TestInternalExternalMasquerade (not in the reference's §7, same file): every
/// source (pod, node, external) to every address (ClusterIP, NodePort, LB) of a Cluster, an
/// eTP=Local and an iTP=Local Service, with and without detect-local and masqueradeAll.
pub(super) fn internal_external_masquerade(mode: Mode) {
    let mut w = world(mode, Opts::default());
    let mut objects = base_objects();
    for (n, lb, policy) in [
        (1, "1.2.3.4", ""),
        (2, "5.6.7.8", "eTP"),
        (3, "9.10.11.12", "iTP"),
    ] {
        let name = format!("svc{n}");
        let mut svc = Service::new(&format!("ns{n}"), &name, &format!("172.30.0.4{n}"))
            .load_balancer(&[lb])
            .port("p80", Proto::Tcp, 80)
            .node_port(3000 + n)
            .health_check_node_port(30000 + n);
        svc = match policy {
            "eTP" => svc.external_local(),
            "iTP" => svc.internal_local(),
            _ => svc,
        };
        objects.push(svc);
        objects.push(
            Slice::new(&format!("ns{n}"), &format!("{name}-a"), &name)
                .port("p80", Proto::Tcp, 80)
                .endpoint(ep(&format!("10.180.0.{n}")).node(NODE_NAME))
                .endpoint(ep(&format!("10.180.1.{n}")).node("remote")),
        );
    }
    let b1 = "10.180.0.1:80, 10.180.1.1:80";
    let b2 = "10.180.0.2:80, 10.180.1.2:80";
    let b3 = "10.180.0.3:80, 10.180.1.3:80";
    let l2 = "10.180.0.2:80";
    let l3 = "10.180.0.3:80";
    #[rustfmt::skip]
    let base: Vec<(&str, &str, &str, &str, bool)> = vec![
        ("pod to ClusterIP",                     POD,     "172.30.0.41:80",   b1, false),
        ("pod to NodePort",                      POD,     "192.168.0.2:3001", b1, true),
        ("pod to LB",                            POD,     "1.2.3.4:80",       b1, true),
        ("node to ClusterIP",                    NODE_IP, "172.30.0.41:80",   b1, true),
        ("node to NodePort",                     NODE_IP, "192.168.0.2:3001", b1, true),
        ("node to LB",                           NODE_IP, "1.2.3.4:80",       b1, true),
        ("external to ClusterIP",                EXT,     "172.30.0.41:80",   b1, true),
        ("external to NodePort",                 EXT,     "192.168.0.2:3001", b1, true),
        ("external to LB",                       EXT,     "1.2.3.4:80",       b1, true),
        ("pod to ClusterIP with eTP:Local",      POD,     "172.30.0.42:80",   b2, false),
        ("pod to NodePort with eTP:Local",       POD,     "192.168.0.2:3002", b2, false),
        ("pod to LB with eTP:Local",             POD,     "5.6.7.8:80",       b2, false),
        ("node to ClusterIP with eTP:Local",     NODE_IP, "172.30.0.42:80",   b2, true),
        // Upstream's "node to NodePort with eTP:Local" probes svc1's NodePort 3001 (its
        // expected output is svc1's endpoints); we probe svc2's 3002 as the name says.
        ("node to NodePort with eTP:Local",      NODE_IP, "192.168.0.2:3002", b2, true),
        ("node to LB with eTP:Local",            NODE_IP, "5.6.7.8:80",       b2, true),
        ("external to ClusterIP with eTP:Local", EXT,     "172.30.0.42:80",   b2, true),
        ("external to NodePort with eTP:Local",  EXT,     "192.168.0.2:3002", l2, false),
        ("external to LB with eTP:Local",        EXT,     "5.6.7.8:80",       l2, false),
        ("pod to ClusterIP with iTP:Local",      POD,     "172.30.0.43:80",   l3, false),
        ("pod to NodePort with iTP:Local",       POD,     "192.168.0.2:3003", b3, true),
        ("pod to LB with iTP:Local",             POD,     "9.10.11.12:80",    b3, true),
        ("node to ClusterIP with iTP:Local",     NODE_IP, "172.30.0.43:80",   l3, true),
        ("node to NodePort with iTP:Local",      NODE_IP, "192.168.0.2:3003", b3, true),
        ("node to LB with iTP:Local",            NODE_IP, "9.10.11.12:80",    b3, true),
        ("external to ClusterIP with iTP:Local", EXT,     "172.30.0.43:80",   l3, true),
        ("external to NodePort with iTP:Local",  EXT,     "192.168.0.2:3003", b3, true),
        ("external to LB with iTP:Local",        EXT,     "9.10.11.12:80",    b3, true),
    ];
    // Per case: the flows whose masquerade or output differs from `base`.
    let no_detector: &[(&str, Option<bool>, Option<&str>)] = &[
        ("node to ClusterIP", Some(false), None),
        ("node to ClusterIP with eTP:Local", Some(false), None),
        ("node to ClusterIP with iTP:Local", Some(false), None),
        ("external to ClusterIP", Some(false), None),
        ("external to ClusterIP with eTP:Local", Some(false), None),
        ("external to ClusterIP with iTP:Local", Some(false), None),
        ("pod to NodePort with eTP:Local", None, Some(l2)),
        ("pod to LB with eTP:Local", None, Some(l2)),
    ];
    let masquerade_all: &[(&str, Option<bool>, Option<&str>)] = &[
        ("pod to ClusterIP", Some(true), None),
        ("pod to ClusterIP with eTP:Local", Some(true), None),
        ("pod to ClusterIP with iTP:Local", Some(true), None),
    ];
    let both: Vec<_> = masquerade_all
        .iter()
        .chain(no_detector.iter().filter(|o| o.2.is_some()))
        .copied()
        .collect();
    let cases = [
        ("base", base_config(), &[][..]),
        (
            "no LocalTrafficDetector",
            ProxyConfig::new(NODE_NAME),
            no_detector,
        ),
        (
            "masqueradeAll",
            base_config().masquerade_all(true),
            masquerade_all,
        ),
        (
            "masqueradeAll, no LocalTrafficDetector",
            ProxyConfig::new(NODE_NAME).masquerade_all(true),
            &both[..],
        ),
    ];
    for (case, config, overrides) in cases {
        w.apply(case, &objects, &config);
        let flows: Vec<Flow> = base
            .iter()
            .map(|&(name, src, dst, out, masq)| {
                let o = overrides.iter().find(|o| o.0 == name);
                let masq = o.and_then(|o| o.1).unwrap_or(masq);
                let out = o.and_then(|o| o.2).unwrap_or(out);
                tcp(name, src, dst, out, masq)
            })
            .collect();
        w.check(&flows);
    }
    w.finish();
}

pub(super) fn masquerade_and_detect_local_modes(mode: Mode) {
    let mut w = world(
        mode,
        Opts {
            pod2: true,
            ..Opts::default()
        },
    );
    let pod_link = w.pod.node_link().unwrap().to_string();
    let slice = |name: &str, svc: &str| {
        Slice::new("ns1", name, svc)
            .port("p80", Proto::Tcp, 80)
            .endpoint(ep("10.180.0.1"))
            .endpoint(ep("10.180.2.1").node(NODE_NAME))
    };
    let objects = base_objects()
        .with(Service::new("ns1", "cip", "172.30.0.90").port("p80", Proto::Tcp, 80))
        .with(slice("cip-a", "cip"))
        .with(
            Service::new("ns1", "lb", "172.30.0.91")
                .load_balancer(&[LB1])
                .external_local()
                .health_check_node_port(30000)
                .port("p80", Proto::Tcp, 80)
                .node_port(3001),
        )
        .with(slice("lb-a", "lb"));
    let both = "10.180.0.1:80, 10.180.2.1:80";
    let local = "10.180.2.1:80";
    // Per mode: is ClusterIP traffic from pod, pod2, external, node masqueraded; where does
    // pod and pod2 traffic to the eTP=Local LB go (short-circuited to all endpoints when the
    // source is detected as local, else to local endpoints only).
    #[rustfmt::skip]
    let modes = [
        ("ClusterCIDR",         base_config(),
         [false, false, true,  true ], [both,  both ]),
        ("masqueradeAll",       base_config().masquerade_all(true),
         [true,  true,  true,  true ], [both,  both ]),
        ("NodeCIDR",            base_config().detect_local_mode("NodeCIDR"),
         [false, true,  true,  true ], [both,  local]),
        ("BridgeInterface",     base_config().bridge_interface(&pod_link),
         [false, true,  true,  true ], [both,  local]),
        ("InterfaceNamePrefix", base_config().interface_name_prefix("vp"),
         [false, false, true,  true ], [both,  both ]),
        ("no detect-local",     ProxyConfig::new(NODE_NAME),
         [false, false, false, false], [local, local]),
    ];
    for (mode, config, [m_pod, m_pod2, m_ext, m_node], [lb_pod, lb_pod2]) in modes {
        w.apply(mode, &objects, &config);
        #[rustfmt::skip]
        let flows = [
            tcp("pod to cluster IP",         POD,     "172.30.0.90:80", both,    m_pod),
            tcp("pod2 to cluster IP",        POD2,    "172.30.0.90:80", both,    m_pod2),
            tcp("external to cluster IP",    EXT,     "172.30.0.90:80", both,    m_ext),
            tcp("node to cluster IP",        NODE_IP, "172.30.0.90:80", both,    m_node),
            tcp("pod to eTP=Local LB",       POD,     "1.2.3.4:80",     lb_pod,  false),
            tcp("pod2 to eTP=Local LB",      POD2,    "1.2.3.4:80",     lb_pod2, false),
            tcp("external to eTP=Local LB",  EXT,     "1.2.3.4:80",     local,   false),
            tcp("node to eTP=Local LB",      NODE_IP, "1.2.3.4:80",     both,    true),
        ];
        w.check(&flows);
    }
    w.finish();
}

// ------------------------------------------------------------------------------------------
// Hairpin: an endpoint reaching itself through its Service is masqueraded, or its own answer
// would bypass the node's reverse translation. Only that endpoint: other clients are not.

pub(super) fn hairpin(mode: Mode) {
    let mut w = world(mode, Opts::default());
    let objects = base_objects()
        .with(Service::new("ns1", "hp", "172.30.0.70").port("", Proto::Tcp, 80))
        .with(
            Slice::new("ns1", "hp-a", "hp")
                .port("", Proto::Tcp, 80)
                .endpoint(ep("10.180.0.1").node(NODE_NAME)),
        )
        .with(
            Service::new("ns1", "hp-udp", "172.30.0.71")
                .port("dns", Proto::Udp, 53)
                .client_ip_affinity(10800),
        )
        .with(
            Slice::new("ns1", "hp-udp-a", "hp-udp")
                .port("dns", Proto::Udp, 53)
                .endpoint(ep("10.180.0.2").node(NODE_NAME)),
        )
        // The same endpoint behind a second Service: deleting one keeps the other's hairpin.
        .with(Service::new("ns1", "hp2", "172.30.0.72").port("", Proto::Tcp, 80))
        .with(
            Slice::new("ns1", "hp2-a", "hp2")
                .port("", Proto::Tcp, 80)
                .endpoint(ep("10.180.0.1").node(NODE_NAME)),
        )
        // An endpoint of no known node may be here.
        .with(Service::new("ns1", "hp-nowhere", "172.30.0.73").port("", Proto::Tcp, 80))
        .with(
            Slice::new("ns1", "hp-nowhere-a", "hp-nowhere")
                .port("", Proto::Tcp, 80)
                .endpoint(ep("10.180.0.3")),
        )
        // A pod on another node reaching this node's eTP=Local NodePort is short-circuited to
        // the cluster endpoints (its source is in the pod network), itself among them.
        .with(
            Service::new("ns1", "hp-etp", "172.30.0.74")
                .node_port_type()
                .external_local()
                .port("", Proto::Tcp, 80)
                .node_port(3005),
        )
        .with(
            Slice::new("ns1", "hp-etp-a", "hp-etp")
                .port("", Proto::Tcp, 80)
                .endpoint(ep("10.180.2.1").node("node2")),
        );
    w.apply("hairpin", &objects, &base_config());
    #[rustfmt::skip]
    w.check(&[
        tcp("endpoint to its own Service",        "10.180.0.1", "172.30.0.70:80", "10.180.0.1:80", true),
        tcp("endpoint to the second Service",     "10.180.0.1", "172.30.0.72:80", "10.180.0.1:80", true),
        flow("endpoint to its own UDP Service with affinity", Proto::Udp, "10.180.0.2", "172.30.0.71:53", "10.180.0.2:53", true),
        tcp("pod to the Service",                 POD,          "172.30.0.70:80", "10.180.0.1:80", false),
        tcp("endpoint of no node to its Service", "10.180.0.3", "172.30.0.73:80", "10.180.0.3:80", true),
        tcp("other node's pod to its own eTP=Local NodePort", "10.180.2.1", "192.168.0.2:3005", "10.180.2.1:80", true),
        tcp("pod to that NodePort",               POD,          "192.168.0.2:3005", "10.180.2.1:80", false),
    ]);
    let objects = base_objects()
        .with(Service::new("ns1", "hp2", "172.30.0.72").port("", Proto::Tcp, 80))
        .with(
            Slice::new("ns1", "hp2-a", "hp2")
                .port("", Proto::Tcp, 80)
                .endpoint(ep("10.180.0.1").node(NODE_NAME)),
        );
    w.apply("hairpin, first Service deleted", &objects, &base_config());
    #[rustfmt::skip]
    w.check(&[
        tcp("endpoint to the second Service", "10.180.0.1", "172.30.0.72:80", "10.180.0.1:80", true),
    ]);
    w.finish();
}
