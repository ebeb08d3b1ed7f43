//! One Service port's iptables rules, from its [`PortDecision`], in kube-proxy's rule shapes
//! (`syncProxyRules` in `pkg/proxy/iptables/proxier.go`).

use std::net::{IpAddr, SocketAddr};

use super::{
    EXTERNAL_SERVICES, IptRuleset, IptTable, MARK_MASQ, NODEPORTS, PROXY_FIREWALL, SERVICES,
    chain_name, comment, endpoint_hash, host, port_name_string, port_proto_hash, proto,
};
use crate::decision::{FrontendKind, InternalMasquerade, PortDecision, Target};
use crate::net::Proto;
use crate::topology::PortEndpoint;

/// The filter verdict and its comment for traffic that reaches no endpoint.
fn refusal(target: Option<Target>, name: &str) -> (&'static str, String) {
    match target {
        Some(Target::Drop) => ("DROP", format!("{name} has no local endpoints")),
        _ => ("REJECT", format!("{name} has no endpoints")),
    }
}

/// The rules of one Service port: dispatch rules, filter verdicts and its own chains
/// (kube-proxy's `syncProxyRules` loop body). `det` is the local-traffic detector as (is
/// local, is not local) fragments.
pub(super) fn add(r: &mut IptRuleset, d: &PortDecision<'_>, det: Option<&(String, String)>) {
    use IptTable::{Filter, Nat};
    let svc = d.svc;
    let name = port_name_string(svc, d.port);
    let p = d.port.protocol;
    let port = d.port.port;
    let hash = port_proto_hash(&name, p.name());
    let cluster_chain = chain_name("SVC", &hash);
    let local_chain = chain_name("SVL", &hash);
    let external_chain = chain_name("EXT", &hash);
    let fw_chain = chain_name("FW", &hash);

    let cluster_ip = d.cluster_ip();
    // (nftables mode also skips a port whose only external frontends are of the other family:
    // see `PortDecision::externally_accessible`.)
    if cluster_ip.is_none() && !d.externally_accessible {
        return;
    }
    let has_endpoints = d.has_endpoints();
    let uses_cluster_chain = !d.cluster_endpoints().is_empty();
    let uses_local_chain = !d.local_endpoints().is_empty();
    let internal_chain = if d.internal_local() {
        &local_chain
    } else {
        &cluster_chain
    };
    let external_policy_chain = if d.external_local() {
        &local_chain
    } else {
        &cluster_chain
    };
    let has_internal = d.internal.is_some_and(Target::has_endpoints);
    let has_external = d.external.is_some_and(|e| e.target.has_endpoints());
    let external_masquerade = d.external.is_some_and(|e| e.masquerade);
    let uses_external_chain = has_endpoints && d.externally_accessible;
    let external_ips: Vec<IpAddr> = d.kept_ips(FrontendKind::ExternalIp).collect();
    let lb_ips: Vec<IpAddr> = d.kept_ips(FrontendKind::LoadBalancerIp).collect();
    let uses_fw_chain = d.firewall.is_some();
    let lb_chain = if uses_fw_chain {
        &fw_chain
    } else {
        &external_chain
    };
    let (internal_target, internal_comment) = refusal(d.internal, &name);
    let (external_target, external_comment) = refusal(d.external.map(|e| e.target), &name);
    r.no_local_endpoints.add(d.no_local_endpoints);
    let to = |ip: IpAddr| format!("{} -d {} --dport {port}", proto(p), host(ip));

    // The ClusterIP, unless another Service keeps it.
    if let Some(cluster_ip) = cluster_ip {
        if has_internal {
            r.push(
                Nat,
                SERVICES,
                format!(
                    "{} {} -j {internal_chain}",
                    comment(&format!("{name} cluster IP")),
                    to(cluster_ip)
                ),
            );
        } else {
            r.push(
                Filter,
                SERVICES,
                format!(
                    "{} {} -j {internal_target}",
                    comment(&internal_comment),
                    to(cluster_ip)
                ),
            );
        }
    }

    // External IPs.
    for ip in &external_ips {
        if has_endpoints {
            r.push(
                Nat,
                SERVICES,
                format!(
                    "{} {} -j {external_chain}",
                    comment(&format!("{name} external IP")),
                    to(*ip)
                ),
            );
        }
        if !has_external {
            r.push(
                Filter,
                EXTERNAL_SERVICES,
                format!(
                    "{} {} -j {external_target}",
                    comment(&external_comment),
                    to(*ip)
                ),
            );
        }
    }

    // Load-balancer IPs.
    for ip in &lb_ips {
        if has_endpoints {
            r.push(
                Nat,
                SERVICES,
                format!(
                    "{} {} -j {lb_chain}",
                    comment(&format!("{name} loadbalancer IP")),
                    to(*ip)
                ),
            );
        }
        if uses_fw_chain {
            r.push(
                Filter,
                PROXY_FIREWALL,
                format!(
                    "{} {} -j DROP",
                    comment(&format!("{name} traffic not accepted by {fw_chain}")),
                    to(*ip)
                ),
            );
        }
    }
    if !has_external {
        for ip in &lb_ips {
            r.push(
                Filter,
                EXTERNAL_SERVICES,
                format!(
                    "{} {} -j {external_target}",
                    comment(&external_comment),
                    to(*ip)
                ),
            );
        }
    }

    // The NodePort (not subject to loadBalancerSourceRanges, as in kube-proxy), unless another
    // Service keeps it.
    if let Some(np) = d.node_port() {
        if has_endpoints {
            r.push(
                Nat,
                NODEPORTS,
                format!(
                    "{} {} --dport {np} -j {external_chain}",
                    comment(&name),
                    proto(p)
                ),
            );
        }
        if !has_external {
            r.push(
                Filter,
                EXTERNAL_SERVICES,
                format!(
                    "{} -m addrtype --dst-type LOCAL {} --dport {np} -j {external_target}",
                    comment(&external_comment),
                    proto(p)
                ),
            );
        }
    }

    // The health-check node port is let in, local endpoints or not.
    if let Some(hc) = d.health_check_node_port {
        r.push(
            Filter,
            NODEPORTS,
            format!(
                "{} {} --dport {hc} -j ACCEPT",
                comment(&format!("{name} health check node port")),
                proto(Proto::Tcp)
            ),
        );
    }

    // Internal traffic: masquerade what does not come from local pods.
    if has_internal && let Some(cluster_ip) = cluster_ip {
        let head = format!(
            "{} {}",
            comment(&format!("{name} cluster IP")),
            to(cluster_ip)
        );
        let masq = match d.internal_masquerade {
            InternalMasquerade::All => Some(format!("{head} -j {MARK_MASQ}")),
            InternalMasquerade::NotFromPods => {
                det.map(|(_, not_local)| format!("{head} {not_local} -j {MARK_MASQ}"))
            }
            InternalMasquerade::None => None,
        };
        if let Some(rule) = masq {
            r.push(Nat, internal_chain, rule);
        }
    }

    // External traffic: NodePorts, external IPs, load-balancer IPs.
    if uses_external_chain {
        let ext = external_chain.as_str();
        r.chain(Nat, ext);
        if external_masquerade {
            r.push(
                Nat,
                ext,
                format!(
                    "{} -j {MARK_MASQ}",
                    comment(&format!(
                        "masquerade traffic for {name} external destinations"
                    ))
                ),
            );
        } else {
            if let Some((local, _)) = det
                && uses_cluster_chain
            {
                // Pods reaching a Service's external address go to any endpoint, as if
                // they had gone out to the load balancer and come back.
                r.push(
                    Nat,
                    ext,
                    format!(
                        "{} {local} -j {cluster_chain}",
                        comment(&format!("pod traffic for {name} external destinations"))
                    ),
                );
            }
            // The host's own traffic is masqueraded (its source is a local address that
            // the endpoint could not answer) and goes to any endpoint.
            r.push(
                Nat,
                ext,
                format!(
                    "{} -m addrtype --src-type LOCAL -j {MARK_MASQ}",
                    comment(&format!(
                        "masquerade LOCAL traffic for {name} external destinations"
                    ))
                ),
            );
            if uses_cluster_chain {
                r.push(
                    Nat,
                    ext,
                    format!(
                        "{} -m addrtype --src-type LOCAL -j {cluster_chain}",
                        comment(&format!(
                            "route LOCAL traffic for {name} external destinations"
                        ))
                    ),
                );
            }
        }
        let policy_exists = if d.external_local() {
            uses_local_chain
        } else {
            uses_cluster_chain
        };
        if has_external && policy_exists {
            r.push(Nat, ext, format!("-j {external_policy_chain}"));
        }
    }

    // loadBalancerSourceRanges: allowed sources continue to the external chain; the rest
    // is left alone here and dropped by filter NFTPROXY-PROXY-FIREWALL (not DNATed).
    if let Some(fw) = &d.firewall {
        let ranges = &fw.ranges;
        let head = comment(&format!("{name} loadbalancer IP"));
        let mut allowed: Vec<String> = ranges.iter().map(ToString::to_string).collect();
        if fw.allow_lb_ips {
            // Node traffic to an LB IP may come back SNATed to that IP.
            allowed.extend(lb_ips.iter().map(|ip| host(*ip)));
        }
        for src in allowed {
            r.push(
                Nat,
                &fw_chain,
                format!("{head} -s {src} -j {external_chain}"),
            );
        }
        r.push(
            Nat,
            &fw_chain,
            comment(&format!(
                "other traffic to {name} will be dropped by {PROXY_FIREWALL}"
            )),
        );
    }

    // Policy chains.
    let sep = |e: &PortEndpoint| {
        let addr = SocketAddr::new(e.addr, e.port);
        (
            chain_name("SEP", &endpoint_hash(&name, p.name(), addr)),
            addr,
        )
    };
    let dispatch = |r: &mut IptRuleset, chain: &str, eps: &[PortEndpoint]| {
        r.chain(Nat, chain);
        if let Some(timeout) = d.affinity_timeout {
            for e in eps {
                let (sep_chain, addr) = sep(e);
                r.push(
                    Nat,
                    chain,
                    format!(
                        "{} -m recent --name {sep_chain} --rcheck --seconds {timeout} --reap -j {sep_chain}",
                        comment(&format!("{name} -> {addr}"))
                    ),
                );
            }
        }
        let n = eps.len();
        for (i, e) in eps.iter().enumerate() {
            let (sep_chain, addr) = sep(e);
            let statistic = if i + 1 < n {
                format!(
                    " -m statistic --mode random --probability {:.10}",
                    1.0 / (n - i) as f64
                )
            } else {
                String::new()
            };
            r.push(
                Nat,
                chain,
                format!(
                    "{}{statistic} -j {sep_chain}",
                    comment(&format!("{name} -> {addr}"))
                ),
            );
        }
    };
    if uses_cluster_chain {
        dispatch(r, &cluster_chain, d.cluster_endpoints());
    }
    if uses_local_chain {
        dispatch(r, &local_chain, d.local_endpoints());
    }

    // Endpoint chains.
    for e in d.endpoints.all_reachable() {
        let (sep_chain, addr) = sep(e);
        let c = comment(&name);
        // Hairpin: an endpoint reaching itself through the Service.
        r.push(
            Nat,
            &sep_chain,
            format!("{c} -s {} -j {MARK_MASQ}", host(e.addr)),
        );
        let recent = if d.affinity_timeout.is_some() {
            format!(" -m recent --name {sep_chain} --set")
        } else {
            String::new()
        };
        r.push(
            Nat,
            &sep_chain,
            format!("{c}{recent} {} -j DNAT --to-destination {addr}", proto(p)),
        );
    }
}
