use super::*;

#[test]
fn rest_client_buckets_are_client_gos() {
    let shown: Vec<String> = rest_client_buckets()
        .into_iter()
        .map(text::go_float)
        .collect();
    assert_eq!(
        shown,
        [
            "0.005", "0.025", "0.1", "0.25", "0.5", "1", "2", "4", "8", "15", "30", "60"
        ]
    );
}

#[test]
fn buckets_are_kube_proxys() {
    let s = sync_buckets();
    assert_eq!(s.len(), 15);
    assert_eq!(text::go_float(s[0]), "0.001");
    assert_eq!(text::go_float(s[14]), "16.384");
    let n = network_programming_buckets();
    assert_eq!(n.len(), 80);
    let shown: Vec<String> = n.iter().map(|b| text::go_float(*b)).collect();
    assert_eq!(&shown[..4], ["0.25", "0.5", "1", "2"]);
    assert_eq!(shown[60], "59");
    assert_eq!(shown[61], "60");
    assert_eq!(shown[72], "115");
    assert_eq!(shown[73], "120");
    assert_eq!(shown[79], "300");
}

#[test]
fn exposition_has_kube_proxys_form() {
    let m = Metrics::new();
    m.observe_sync(Family::V4, true, Duration::from_millis(3));
    m.sync_succeeded(
        Family::V4,
        UNIX_EPOCH + Duration::from_millis(1_733_400_000_500),
    );
    m.set_no_local_endpoints(
        Family::V6,
        NoLocalEndpoints {
            internal: 1,
            external: 0,
        },
    );
    m.set_no_local_endpoints(
        Family::V4,
        NoLocalEndpoints {
            internal: 2,
            external: 0,
        },
    );
    m.healthz(503);
    m.healthz(200);
    let text = m.encode();
    let want_histogram = "\
# HELP kubeproxy_sync_full_proxy_rules_duration_seconds [ALPHA] SyncProxyRules latency in seconds for full resyncs
# TYPE kubeproxy_sync_full_proxy_rules_duration_seconds histogram
kubeproxy_sync_full_proxy_rules_duration_seconds_bucket{ip_family=\"IPv4\",le=\"0.001\"} 0
kubeproxy_sync_full_proxy_rules_duration_seconds_bucket{ip_family=\"IPv4\",le=\"0.002\"} 0
kubeproxy_sync_full_proxy_rules_duration_seconds_bucket{ip_family=\"IPv4\",le=\"0.004\"} 1
";
    assert!(text.contains(want_histogram), "{text}");
    assert!(text.contains(
        "kubeproxy_sync_full_proxy_rules_duration_seconds_bucket{ip_family=\"IPv4\",le=\"16.384\"} 1\n\
             kubeproxy_sync_full_proxy_rules_duration_seconds_bucket{ip_family=\"IPv4\",le=\"+Inf\"} 1\n\
             kubeproxy_sync_full_proxy_rules_duration_seconds_sum{ip_family=\"IPv4\"} 0.003\n\
             kubeproxy_sync_full_proxy_rules_duration_seconds_count{ip_family=\"IPv4\"} 1\n"
    ));
    assert!(text.contains(
        "kubeproxy_sync_proxy_rules_last_timestamp_seconds{ip_family=\"IPv4\"} 1.7334000005e+09\n"
    ));
    // Labels sorted by name, series by label values.
    assert!(text.contains(
        "# TYPE kubeproxy_sync_proxy_rules_no_local_endpoints_total gauge\n\
             kubeproxy_sync_proxy_rules_no_local_endpoints_total{ip_family=\"IPv4\",traffic_policy=\"external\"} 0\n\
             kubeproxy_sync_proxy_rules_no_local_endpoints_total{ip_family=\"IPv4\",traffic_policy=\"internal\"} 2\n\
             kubeproxy_sync_proxy_rules_no_local_endpoints_total{ip_family=\"IPv6\",traffic_policy=\"external\"} 0\n"
    ));
    assert!(text.contains(
        "# HELP kubeproxy_proxy_healthz_total [ALPHA] Cumulative proxy healthz HTTP status\n\
             # TYPE kubeproxy_proxy_healthz_total counter\n\
             kubeproxy_proxy_healthz_total{code=\"200\"} 1\n\
             kubeproxy_proxy_healthz_total{code=\"503\"} 1\n"
    ));
    // Unlabelled metrics are always present; empty families are not.
    assert!(text.contains("kubeproxy_sync_proxy_rules_service_changes_total 0\n"));
    assert!(!text.contains("kubeproxy_proxy_livez_total"));
    assert!(text.contains("nftproxy_build_info{version=\""));
    // Families in name order.
    let names: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .map(|l| l.split(' ').next().unwrap())
        .collect();
    let mut sorted = names.clone();
    sorted.sort();
    assert_eq!(names, sorted);
}

#[test]
fn rest_client_metrics_have_client_gos_form() {
    let m = Metrics::new();
    let host = "192.168.0.10:6443";
    m.rest_client_request("200", "GET", host);
    m.rest_client_request("200", "GET", host);
    m.rest_client_request(REST_CLIENT_ERROR_CODE, "GET", host);
    m.observe_rest_client_duration("GET", host, Duration::from_millis(30));
    let text = m.encode();
    assert!(
        text.contains(
            "# HELP rest_client_requests_total [ALPHA] Number of HTTP requests, partitioned by status code, method, and host.\n\
                 # TYPE rest_client_requests_total counter\n\
                 rest_client_requests_total{code=\"200\",host=\"192.168.0.10:6443\",method=\"GET\"} 2\n\
                 rest_client_requests_total{code=\"<error>\",host=\"192.168.0.10:6443\",method=\"GET\"} 1\n"
        ),
        "{text}"
    );
    assert!(text.contains(
        "# HELP rest_client_request_duration_seconds [ALPHA] Request latency in seconds. Broken down by verb, and host.\n\
             # TYPE rest_client_request_duration_seconds histogram\n\
             rest_client_request_duration_seconds_bucket{host=\"192.168.0.10:6443\",verb=\"GET\",le=\"0.005\"} 0\n\
             rest_client_request_duration_seconds_bucket{host=\"192.168.0.10:6443\",verb=\"GET\",le=\"0.025\"} 0\n\
             rest_client_request_duration_seconds_bucket{host=\"192.168.0.10:6443\",verb=\"GET\",le=\"0.1\"} 1\n"
    ));
    assert!(text.contains(
        "rest_client_request_duration_seconds_bucket{host=\"192.168.0.10:6443\",verb=\"GET\",le=\"60\"} 1\n\
             rest_client_request_duration_seconds_bucket{host=\"192.168.0.10:6443\",verb=\"GET\",le=\"+Inf\"} 1\n"
    ));
}

#[test]
fn process_metrics_have_client_golangs_form() {
    let m = Metrics::new();
    let text = m.encode();
    for (name, help, kind) in [
        (
            "process_cpu_seconds_total",
            "Total user and system CPU time spent in seconds.",
            "counter",
        ),
        (
            "process_open_fds",
            "Number of open file descriptors.",
            "gauge",
        ),
        (
            "process_max_fds",
            "Maximum number of open file descriptors.",
            "gauge",
        ),
        (
            "process_resident_memory_bytes",
            "Resident memory size in bytes.",
            "gauge",
        ),
        (
            "process_virtual_memory_bytes",
            "Virtual memory size in bytes.",
            "gauge",
        ),
        (
            "process_virtual_memory_max_bytes",
            "Maximum amount of virtual memory available in bytes.",
            "gauge",
        ),
        (
            "process_start_time_seconds",
            "Start time of the process since unix epoch in seconds.",
            "gauge",
        ),
    ] {
        let want = format!("# HELP {name} {help}\n# TYPE {name} {kind}\n{name} ");
        assert!(text.contains(&want), "{want}\n{text}");
    }
    // No stability prefix: client_golang's collector is registered raw, as in kube-proxy.
    assert!(!text.contains("[ALPHA] Resident"));
    let names = m.family_names();
    for name in [
        "process_cpu_seconds_total",
        "process_network_receive_bytes_total",
        "rest_client_requests_total",
        "rest_client_request_duration_seconds",
    ] {
        assert!(names.iter().any(|n| n == name), "{name}: {names:?}");
    }
}

#[test]
fn change_counters_follow_the_tracker() {
    let m = Metrics::new();
    let mut c = dataplane::tracker::ChangeCounts {
        service_events: 3,
        slice_events: 5,
        services_pending: 1,
        endpoints_pending: 2,
    };
    m.set_changes(c);
    c.service_events = 4;
    c.services_pending = 0;
    m.set_changes(c);
    let text = m.encode();
    assert!(text.contains("kubeproxy_sync_proxy_rules_service_changes_total 4\n"));
    assert!(text.contains("kubeproxy_sync_proxy_rules_endpoint_changes_total 5\n"));
    assert!(text.contains("kubeproxy_sync_proxy_rules_service_changes_pending 0\n"));
    assert!(text.contains("kubeproxy_sync_proxy_rules_endpoint_changes_pending 2\n"));
}

#[test]
fn invalid_objects_and_conflicts() {
    let m = Metrics::new();
    m.set_invalid_objects([("Service", "invalid_ip", 2)]);
    m.set_invalid_objects([("Service", "schema", 1)]);
    let text = m.encode();
    assert!(text.contains("nftproxy_invalid_objects{kind=\"Service\",reason=\"schema\"} 1\n"));
    assert!(!text.contains("invalid_ip"));
    m.set_frontend_conflicts([("cluster-ip", 0), ("external-ip", 2)]);
    let text = m.encode();
    assert!(text.contains("nftproxy_frontend_conflicts{kind=\"external-ip\"} 2\n"));
    assert!(text.contains("nftproxy_frontend_conflicts{kind=\"cluster-ip\"} 0\n"));
}

#[test]
fn iptables_metrics() {
    let m = Metrics::new();
    m.set_iptables_rules(Family::V4, "nat", 120, 4);
    m.iptables_restore_failed(Family::V6, true);
    m.iptables_restore_failed(Family::V6, false);
    let text = m.encode();
    assert!(text.contains(
        "# HELP kubeproxy_sync_proxy_rules_iptables_total [ALPHA] Total number of iptables rules owned by kube-proxy\n\
             # TYPE kubeproxy_sync_proxy_rules_iptables_total gauge\n\
             kubeproxy_sync_proxy_rules_iptables_total{ip_family=\"IPv4\",table=\"nat\"} 120\n"
    ));
    assert!(text.contains(
        "kubeproxy_sync_proxy_rules_iptables_last{ip_family=\"IPv4\",table=\"nat\"} 4\n"
    ));
    assert!(text.contains(
        "kubeproxy_sync_proxy_rules_iptables_restore_failures_total{ip_family=\"IPv6\"} 2\n"
    ));
    assert!(text.contains(
        "kubeproxy_sync_proxy_rules_iptables_partial_restore_failures_total{ip_family=\"IPv6\"} 1\n"
    ));
}
