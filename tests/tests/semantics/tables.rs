//! kube-proxy's packet-flow tables (reference §7.1, §7.3–§7.8).

use super::*;

// ------------------------------------------------------------------------------------------
// §7.1 TestNoEndpointsReject

pub(super) fn no_endpoints_reject(mode: Mode) {
    let mut w = world(mode, Opts::default());
    let objects = base_objects().with(
        Service::new("ns1", "svc1", "172.30.0.41")
            .load_balancer(&[LB1])
            .external_ips(&[NODE_EXTERNAL_IP])
            .port("p80", Proto::Tcp, 80)
            .node_port(3001),
    );
    w.apply("7.1", &objects, &base_config());
    use Proto::*;
    #[rustfmt::skip]
    let flows = [
        tcp("pod to cluster IP",       POD, "172.30.0.41:80",   "REJECT", false),
        tcp("external to external IP", EXT, "192.168.99.11:80", "REJECT", false),
        tcp("pod to NodePort",         POD, "192.168.0.2:3001", "REJECT", false),
        tcp("external to NodePort",    EXT, "192.168.0.2:3001", "REJECT", false),
        tcp("pod to LB",               POD, "1.2.3.4:80",       "REJECT", false),
        tcp("external to LB",          EXT, "1.2.3.4:80",       "REJECT", false),
        // Beyond the table: the node itself (output hooks), and the other protocols.
        tcp("node to cluster IP",       NODE_IP, "172.30.0.41:80",   "REJECT", false),
        tcp("node to its external IP",  NODE_IP, "192.168.99.11:80", "REJECT", false),
        tcp("node to its NodePort",     NODE_IP, "192.168.0.2:3001", "REJECT", false),
        tcp("node to LB",               NODE_IP, "1.2.3.4:80",       "REJECT", false)
            .iptables("DROP", false, NO_LB_REJECT_FROM_HOST),
        flow("UDP to the TCP port",  Udp,  POD, "172.30.0.41:80", "REJECT", false)
            .iptables("DROP", false, NO_WRONG_PORT_REJECT),
        flow("SCTP to the TCP port", Sctp, POD, "172.30.0.41:80", "REJECT", false)
            .iptables("DROP", false, NO_WRONG_PORT_REJECT),
    ];
    w.check(&flows);
    w.finish();
}

// ------------------------------------------------------------------------------------------
// §7.3 TestLoadBalancer

pub(super) fn load_balancer(mode: Mode) {
    let mut w = world(
        mode,
        Opts {
            lbsrc: true,
            ..Opts::default()
        },
    );
    let objects = base_objects()
        .with(
            Service::new("ns1", "svc1", "172.30.0.41")
                .load_balancer(&[LB1, LB2])
                .port("p80", Proto::Tcp, 80)
                .node_port(3001)
                .source_ranges(&["192.168.0.0/24", " 203.0.113.0/25"]),
        )
        .with(
            Slice::new("ns1", "svc1-a", "svc1")
                .port("p80", Proto::Tcp, 80)
                .endpoint(ep("10.180.0.1")),
        )
        // Beyond the table: ranges without the node IP do not let the node (or LB1) in.
        .with(
            Service::new("ns1", "svc2", "172.30.0.42")
                .load_balancer(&["1.2.3.5"])
                .port("p80", Proto::Tcp, 80)
                .node_port(3002)
                .source_ranges(&["203.0.113.0/25"]),
        )
        .with(
            Slice::new("ns1", "svc2-a", "svc2")
                .port("p80", Proto::Tcp, 80)
                .endpoint(ep("10.180.2.1")),
        );
    w.apply("7.3", &objects, &base_config());
    let e = "10.180.0.1:80";
    let e2 = "10.180.2.1:80";
    #[rustfmt::skip]
    let flows = [
        tcp("pod to cluster IP",                     POD,         "172.30.0.41:80",   e,      false),
        tcp("external to nodePort",                  EXT,         "192.168.0.2:3001", e,      true),
        tcp("nodePort bypasses LBSourceRanges",      EXT_BLOCKED, "192.168.0.2:3001", e,      true),
        tcp("accepted external to LB1",              EXT,         "1.2.3.4:80",       e,      true),
        tcp("accepted external to LB2",              EXT,         "5.6.7.8:80",       e,      true),
        tcp("blocked external to LB1",               EXT_BLOCKED, "1.2.3.4:80",       "DROP", false),
        tcp("blocked external to LB2",               EXT_BLOCKED, "5.6.7.8:80",       "DROP", false),
        tcp("pod to LB1 (blocked by ranges)",        POD,         "1.2.3.4:80",       "DROP", false),
        tcp("pod to LB2 (blocked by ranges)",        POD,         "5.6.7.8:80",       "DROP", false),
        tcp("node to LB1 (allowed by ranges)",       NODE_IP,     "1.2.3.4:80",       e,      true),
        tcp("node to LB2 (allowed by ranges)",       NODE_IP,     "5.6.7.8:80",       e,      true),
        tcp("same node to LB1, SNATted to LB1",      LB1,         "1.2.3.4:80",       e,      true),
        tcp("same node to LB2, SNATted to LB2",      LB2,         "5.6.7.8:80",       e,      true),
        tcp("svc2: accepted external",               EXT,         "1.2.3.5:80",       e2,     true),
        tcp("svc2: blocked external",                EXT_BLOCKED, "1.2.3.5:80",       "DROP", false),
        tcp("svc2: node (not in ranges)",            NODE_IP,     "1.2.3.5:80",       "DROP", false),
        tcp("svc2: SNATted to LB1 (not in ranges)",  LB1,         "1.2.3.5:80",       "DROP", false),
        tcp("svc2: pod",                             POD,         "1.2.3.5:80",       "DROP", false),
        tcp("svc2: blocked external to nodePort",    EXT_BLOCKED, "192.168.0.2:3002", e2,     true),
    ];
    w.check(&flows);
    w.finish();
}

// ------------------------------------------------------------------------------------------
// §7.4 TestNodePorts

pub(super) fn node_ports(mode: Mode, v6: bool) {
    let mut w = world(mode, Opts::default());
    let (cip, ep1, ep2) = if v6 {
        ("fd00:172:30::41", "fd00:10:180::1", "fd00:10:180::2:1")
    } else {
        ("172.30.0.41", "10.180.0.1", "10.180.2.1")
    };
    let objects = base_objects()
        .with(
            Service::new("ns1", "svc1", cip)
                .node_port_type()
                .port("p80", Proto::Tcp, 80)
                .node_port(3001),
        )
        .with(
            Slice::new("ns1", "svc1-a", "svc1")
                .port("p80", Proto::Tcp, 80)
                .endpoint(ep(ep1))
                .endpoint(ep(ep2).node(NODE_NAME)),
        );
    let at = |a: &str, port: u16| SocketAddr::new(ip(a), port).to_string();
    let both = format!("{}, {}", at(ep1, 80), at(ep2, 80));
    let (pod, ext, primary, alt) = if v6 {
        (POD6, EXT6, NODE_IP6, NODE_ALT6)
    } else {
        (POD, EXT, NODE_IP, NODE_ALT)
    };
    let multiple: &[&str] = if v6 {
        &[
            "192.168.0.0/24",
            "192.168.1.0/24",
            "2001:db8::/64",
            "2001:db8:1::2/128",
        ]
    } else {
        &["192.168.0.0/24", "192.168.1.0/24", "2001:db8::/64"]
    };
    let family = if v6 { "ipv6" } else { "ipv4" };
    let harness_default = ["192.168.0.2/32", "2001:db8::1/128"];
    #[rustfmt::skip]
    let subtests = [
        // The default: nftables mode, the Node's primary IPs; iptables mode, every local
        // address and, for IPv4, 127.0.0.1.
        (format!("{family}, default"), base_config(), "", false, true),
        // kube-proxy's harness default.
        (format!("{family}, {}", harness_default.join(" ")),
         base_config().node_port_addresses(&harness_default), "", false, false),
        (format!("{family}, multiple"), base_config().node_port_addresses(multiple), both.as_str(), true, false),
    ];
    let localhost = if v6 { "::1" } else { "127.0.0.1" };
    for (case, config, alt_want, alt_masq, default) in subtests {
        w.apply(&case, &objects, &config);
        let mut alt_flow = tcp(
            "external to nodePort on alternate IP",
            ext,
            &at(alt, 3001),
            alt_want,
            alt_masq,
        );
        let mut localhost_flow = tcp(
            "node to localhost nodePort",
            localhost,
            &at(localhost, 3001),
            "",
            false,
        );
        if default {
            alt_flow = alt_flow.iptables(&both, true, NODE_PORTS_ON_ALL_ADDRESSES);
            if !v6 {
                localhost_flow = localhost_flow.iptables(&both, true, LOCALHOST_NODE_PORTS);
            }
        }
        #[rustfmt::skip]
        let flows = [
            tcp("pod to cluster IP",     pod,     &at(cip, 80),       &both,    false),
            tcp("external to nodePort",  ext,     &at(primary, 3001), &both,    true),
            tcp("node to nodePort",      primary, &at(primary, 3001), &both,    true),
            alt_flow,
            localhost_flow,
        ];
        w.check(&flows);
    }
    w.finish();
}

pub(super) fn node_ports_ipv4(mode: Mode) {
    node_ports(mode, false);
}

pub(super) fn node_ports_ipv6(mode: Mode) {
    node_ports(mode, true);
}

// ------------------------------------------------------------------------------------------
// §7.5 TestExternalTrafficPolicyLocal / TestExternalTrafficPolicyCluster

pub(super) fn external_traffic_policy(mode: Mode, local: bool) {
    let mut w = world(mode, Opts::default());
    // kube-proxy's Service is IPv4 only; ours is dual-stack (same IPv4 table) so that the IPv6
    // rules are checked too, beyond the table.
    let mut svc = Service::with_cluster_ips("ns1", "svc1", &["172.30.0.41", "fd00:172:30::41"])
        .load_balancer(&[LB1, LB6])
        .external_ips(&[NODE_EXTERNAL_IP])
        .port("p80", Proto::Tcp, 80)
        .target_port("80")
        .node_port(3001);
    let mut svc2 = Service::new("ns1", "svc2", "172.30.0.42")
        .load_balancer(&[LB2])
        .external_ips(&[NODE_ALT])
        .port("p80", Proto::Tcp, 80)
        .node_port(3002);
    if local {
        svc = svc.external_local().health_check_node_port(30000);
        svc2 = svc2.external_local().health_check_node_port(30001);
    }
    let objects = base_objects()
        .with(svc)
        .with(
            Slice::new("ns1", "svc1-a", "svc1")
                .port("p80", Proto::Tcp, 80)
                .endpoint(ep("10.180.0.1"))
                .endpoint(ep("10.180.2.1").node(NODE_NAME)),
        )
        .with(
            Slice::new("ns1", "svc1-b", "svc1")
                .port("p80", Proto::Tcp, 80)
                .endpoint(ep("fd00:10:180::1"))
                .endpoint(ep("fd00:10:180::2:1").node(NODE_NAME)),
        )
        // Beyond the table: the same policy with no local endpoint.
        .with(svc2)
        .with(
            Slice::new("ns1", "svc2-a", "svc2")
                .port("p80", Proto::Tcp, 80)
                .endpoint(ep("10.180.0.1").node("node2")),
        );
    let case = if local {
        "7.5 eTP=Local"
    } else {
        "7.5 eTP=Cluster"
    };
    w.apply(case, &objects, &base_config());
    let both = "10.180.0.1:80, 10.180.2.1:80";
    let both6 = "[fd00:10:180::1]:80, [fd00:10:180::2:1]:80";
    let remote = "10.180.0.1:80";
    let ext_remote = if local { "DROP" } else { remote };
    let (ext, ext6, masq) = if local {
        ("10.180.2.1:80", "[fd00:10:180::2:1]:80", false)
    } else {
        (both, both6, true)
    };
    #[rustfmt::skip]
    let flows = [
        tcp("pod to cluster IP",       POD, "172.30.0.41:80",   both, false),
        tcp("pod to external IP",      POD, "192.168.99.11:80", both, masq),
        tcp("external to external IP", EXT, "192.168.99.11:80", ext,  masq),
        tcp("pod to LB",               POD, "1.2.3.4:80",       both, masq),
        tcp("external to LB",          EXT, "1.2.3.4:80",       ext,  masq),
        tcp("pod to NodePort",         POD, "192.168.0.2:3001", both, masq),
        tcp("external to NodePort",    EXT, "192.168.0.2:3001", ext,  masq),
        // Beyond the table: the node's own traffic is short-circuited and masqueraded.
        tcp("node to external IP", NODE_IP, "192.168.99.11:80", both, true),
        tcp("node to LB",          NODE_IP, "1.2.3.4:80",       both, true),
        tcp("node to NodePort",    NODE_IP, "192.168.0.2:3001", both, true),
        // Beyond the table: the same in IPv6.
        tcp("IPv6 pod to cluster IP",    POD6,     "[fd00:172:30::41]:80", both6, false),
        tcp("IPv6 pod to LB",            POD6,     "[2001:db8:ff::4]:80",  both6, masq),
        tcp("IPv6 external to LB",       EXT6,     "[2001:db8:ff::4]:80",  ext6,  masq),
        tcp("IPv6 pod to NodePort",      POD6,     "[2001:db8::1]:3001",   both6, masq),
        tcp("IPv6 external to NodePort", EXT6,     "[2001:db8::1]:3001",   ext6,  masq),
        tcp("IPv6 node to LB",           NODE_IP6, "[2001:db8:ff::4]:80",  both6, true),
        tcp("IPv6 node to NodePort",     NODE_IP6, "[2001:db8::1]:3001",   both6, true),
        // svc2: external traffic is dropped (eTP=Local); pod and node traffic is short-circuited
        // before the no-endpoint check could drop it.
        tcp("svc2: pod to cluster IP",       POD,     "172.30.0.42:80",   remote,     false),
        tcp("svc2: external to LB",          EXT,     "5.6.7.8:80",       ext_remote, masq),
        tcp("svc2: external to external IP", EXT,     "192.168.1.2:80",   ext_remote, masq),
        tcp("svc2: external to NodePort",    EXT,     "192.168.0.2:3002", ext_remote, masq),
        tcp("svc2: pod to LB",               POD,     "5.6.7.8:80",       remote,     masq),
        tcp("svc2: pod to external IP",      POD,     "192.168.1.2:80",   remote,     masq),
        tcp("svc2: pod to NodePort",         POD,     "192.168.0.2:3002", remote,     masq),
        tcp("svc2: node to LB",              NODE_IP, "5.6.7.8:80",       remote,     true),
        tcp("svc2: node to NodePort",        NODE_IP, "192.168.0.2:3002", remote,     true),
    ];
    w.check(&flows);
    w.finish();
}

pub(super) fn external_traffic_policy_local(mode: Mode) {
    external_traffic_policy(mode, true);
}

pub(super) fn external_traffic_policy_cluster(mode: Mode) {
    external_traffic_policy(mode, false);
}

// ------------------------------------------------------------------------------------------
// §7.6 TestInternalTrafficPolicy

pub(super) fn internal_traffic_policy(mode: Mode) {
    let mut w = world(mode, Opts::default());
    let svc = |local: bool| {
        let s = Service::new("ns1", "svc1", "172.30.1.1").port("", Proto::Tcp, 80);
        if local { s.internal_local() } else { s }
    };
    let slice = |nodes: [&str; 3]| {
        Slice::new("ns1", "svc1-a", "svc1")
            .port("", Proto::Tcp, 80)
            .endpoint(ep("10.0.1.1").node(nodes[0]))
            .endpoint(ep("10.0.1.2").node(nodes[1]))
            .endpoint(ep("10.0.1.3").node(nodes[2]))
    };
    let me = NODE_NAME;
    #[rustfmt::skip]
    let cases = [
        ("a: iTP=Cluster",       false, [me, "node1", "node2"],      "10.0.1.1:80, 10.0.1.2:80, 10.0.1.3:80"),
        ("b: iTP=Local",         true,  [me, "node1", "node2"],      "10.0.1.1:80"),
        ("c: iTP=Local, 2 local", true, [me, me, "node2"],           "10.0.1.1:80, 10.0.1.2:80"),
        ("d: iTP=Local, 0 local", true, ["node0", "node1", "node2"], "DROP"),
    ];
    for (case, local, nodes, want) in cases {
        let objects = base_objects().with(svc(local)).with(slice(nodes));
        w.apply(&format!("7.6 {case}"), &objects, &base_config());
        w.check(&[
            tcp("pod to cluster IP", POD, "172.30.1.1:80", want, false),
            // Beyond the table: iTP does not change the masquerade of the node's own traffic.
            tcp("node to cluster IP", NODE_IP, "172.30.1.1:80", want, true),
        ]);
        let objects = base_objects().with(svc(local));
        w.apply(
            &format!("7.6 {case}, slice deleted"),
            &objects,
            &base_config(),
        );
        w.check(&[tcp(
            "pod to cluster IP",
            POD,
            "172.30.1.1:80",
            "REJECT",
            false,
        )]);
    }
    w.finish();
}

// ------------------------------------------------------------------------------------------
// §7.7 / §7.8 TestTerminatingEndpointsTrafficPolicyLocal / ...Cluster

pub(super) fn terminating_endpoints(mode: Mode, local: bool) {
    let mut w = world(mode, Opts::default());
    let mut svc = Service::new("ns1", "svc1", "172.30.1.1")
        .load_balancer(&[LB1])
        .port("", Proto::Tcp, 80)
        .target_port("80");
    if local {
        svc = svc.external_local().health_check_node_port(30000);
    }
    let slice = |eps: Vec<Endpoint>| {
        Slice::new("ns1", "svc1-a", "svc1")
            .port("", Proto::Tcp, 80)
            .endpoints(eps)
    };
    // An endpoint 10.0.1.n with its (ready, serving, terminating) conditions, on a node.
    let e = |n: u8, rst: (bool, bool, bool), node: &str| {
        ep_rst(&format!("10.0.1.{n}"), rst.0, rst.1, rst.2, node)
    };
    const RSN: (bool, bool, bool) = (true, true, false); // ready, serving, not terminating
    const NST: (bool, bool, bool) = (false, true, true); // serving while terminating
    const NNT: (bool, bool, bool) = (false, false, true); // terminating, not serving
    let me = NODE_NAME;
    #[rustfmt::skip]
    let cases: Vec<(&str, Vec<Endpoint>, &str, &str)> = if local {
        let n1 = "node-1";
        vec![
            ("ready endpoints exist",
             vec![e(1, RSN, me), e(2, RSN, me), e(3, NST, me), e(4, NNT, me), e(5, RSN, n1)],
             "10.0.1.1:80, 10.0.1.2:80, 10.0.1.5:80", "10.0.1.1:80, 10.0.1.2:80"),
            ("only terminating endpoints exist",
             vec![e(2, NST, me), e(3, NST, me), e(4, NNT, me), e(5, RSN, n1)],
             "10.0.1.5:80", "10.0.1.2:80, 10.0.1.3:80"),
            ("terminating endpoints on remote node",
             vec![e(5, NST, n1)],
             "10.0.1.5:80", "DROP"),
            ("no usable endpoints on any node",
             vec![e(5, NNT, me), e(5, NNT, n1)],
             "REJECT", "REJECT"),
        ]
    } else {
        let an = "another-node";
        vec![
            ("ready endpoints exist",
             vec![e(1, RSN, me), e(2, RSN, me), e(3, NST, an), e(4, NNT, an), e(5, RSN, an)],
             "10.0.1.1:80, 10.0.1.2:80, 10.0.1.5:80", "10.0.1.1:80, 10.0.1.2:80, 10.0.1.5:80"),
            ("only terminating endpoints exist",
             vec![e(2, NST, me), e(3, NST, me), e(4, NNT, an), e(5, NST, an)],
             "10.0.1.2:80, 10.0.1.3:80, 10.0.1.5:80", "10.0.1.2:80, 10.0.1.3:80, 10.0.1.5:80"),
            ("terminating endpoints on remote node",
             vec![e(5, NST, "node-1")],
             "10.0.1.5:80", "10.0.1.5:80"),
            ("no usable endpoints on any node",
             vec![e(5, NNT, me), e(5, NNT, "node-1")],
             "REJECT", "REJECT"),
        ]
    };
    // External traffic is masqueraded for eTP=Cluster only.
    let e_masq = !local;
    let section = if local {
        "7.7 eTP=Local"
    } else {
        "7.8 eTP=Cluster"
    };
    for (case, eps, p_want, e_want) in cases {
        let objects = base_objects().with(svc.clone()).with(slice(eps));
        w.apply(&format!("{section}: {case}"), &objects, &base_config());
        w.check(&[
            tcp("P: pod to cluster IP", POD, "172.30.1.1:80", p_want, false),
            tcp("E: external to LB", EXT, "1.2.3.4:80", e_want, e_masq),
            // Beyond the table: pod and node traffic to the LB uses the cluster endpoints
            // (short-circuited with eTP=Local), the node's masqueraded.
            tcp("pod to LB", POD, "1.2.3.4:80", p_want, e_masq),
            if p_want == "REJECT" {
                tcp("node to LB", NODE_IP, "1.2.3.4:80", p_want, true).iptables(
                    "DROP",
                    false,
                    NO_LB_REJECT_FROM_HOST,
                )
            } else {
                tcp("node to LB", NODE_IP, "1.2.3.4:80", p_want, true)
            },
        ]);
        let objects = base_objects().with(svc.clone());
        w.apply(
            &format!("{section}: {case}, slice deleted"),
            &objects,
            &base_config(),
        );
        w.check(&[
            tcp(
                "P: pod to cluster IP",
                POD,
                "172.30.1.1:80",
                "REJECT",
                false,
            ),
            tcp("E: external to LB", EXT, "1.2.3.4:80", "REJECT", false),
        ]);
    }
    w.finish();
}

pub(super) fn terminating_endpoints_external_policy_local(mode: Mode) {
    terminating_endpoints(mode, true);
}

pub(super) fn terminating_endpoints_external_policy_cluster(mode: Mode) {
    terminating_endpoints(mode, false);
}
