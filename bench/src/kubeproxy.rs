//! The baseline: the same cluster in kube-proxy's nftables ruleset shape (table
//! `ip kube-proxy`), as the `nft -f` text knftables writes (reference kube-proxy-nftables.md
//! §1.14 and the §1.15 recipe): one `service-…` chain per Service port with an anonymous
//! `numgen random mod k vmap { … }`, one `endpoint-…` chain per endpoint, `external-…` chains
//! for NodePort/LoadBalancer Services, the same maps and sets. IPv4 only.
//!
//! Endpoint selection uses the same categorisation as nftproxy (kube-proxy's
//! `CategorizeEndpoints`), so both rulesets send traffic to the same endpoints.

use std::fmt::Write;

use dataplane::convert::slices_by_service;
use dataplane::model::{Cluster, EndpointSlice, Service, ServicePort};
use dataplane::nft::build::{hash_and_truncate, port_endpoints};
use dataplane::nft::ruleset::Family;
use dataplane::topology::{NodeTopology, PortEndpoint, Usage, categorize};

const T: &str = "ip kube-proxy";

/// The rules every full sync writes (kube-proxy's `baseRules`), for an IPv4 node.
pub fn base_text(service_cidr: &str, node_ip: &str) -> String {
    format!(
        r#"add table {T} {{ comment "rules for kube-proxy" ; }}
add set {T} cluster-ips {{ type ipv4_addr ; comment "Active ClusterIPs" ; }}
add set {T} nodeport-ips {{ type ipv4_addr ; comment "IPs that accept NodePort traffic" ; }}
add map {T} firewall-ips {{ type ipv4_addr . inet_proto . inet_service : verdict ; comment "destinations that are subject to LoadBalancerSourceRanges" ; }}
add map {T} no-endpoint-nodeports {{ type inet_proto . inet_service : verdict ; comment "vmap to drop or reject packets to service nodeports with no endpoints" ; }}
add map {T} no-endpoint-services {{ type ipv4_addr . inet_proto . inet_service : verdict ; comment "vmap to drop or reject packets to services with no endpoints" ; }}
add map {T} service-ips {{ type ipv4_addr . inet_proto . inet_service : verdict ; comment "ClusterIP, ExternalIP and LoadBalancer IP traffic" ; }}
add map {T} service-nodeports {{ type inet_proto . inet_service : verdict ; comment "NodePort traffic" ; }}
flush set {T} cluster-ips
flush set {T} nodeport-ips
flush map {T} firewall-ips
flush map {T} no-endpoint-nodeports
flush map {T} no-endpoint-services
flush map {T} service-ips
flush map {T} service-nodeports
add chain {T} cluster-ips-check
add chain {T} filter-prerouting-pre-dnat {{ type filter hook prerouting priority -110 ; }}
add chain {T} filter-output-pre-dnat {{ type filter hook output priority -110 ; }}
add chain {T} filter-forward {{ type filter hook forward priority 0 ; }}
add chain {T} filter-input {{ type filter hook input priority 0 ; }}
add chain {T} filter-output {{ type filter hook output priority 0 ; }}
add chain {T} firewall-check
add chain {T} mark-for-masquerade
add chain {T} masquerading
add chain {T} nat-output {{ type nat hook output priority -100 ; }}
add chain {T} nat-postrouting {{ type nat hook postrouting priority 100 ; }}
add chain {T} nat-prerouting {{ type nat hook prerouting priority -100 ; }}
add chain {T} nodeport-endpoints-check
add chain {T} reject-chain {{ comment "helper for @no-endpoint-services / @no-endpoint-nodeports" ; }}
add chain {T} services
add chain {T} service-endpoints-check
flush chain {T} cluster-ips-check
flush chain {T} filter-prerouting-pre-dnat
flush chain {T} filter-output-pre-dnat
flush chain {T} filter-forward
flush chain {T} filter-input
flush chain {T} filter-output
flush chain {T} firewall-check
flush chain {T} mark-for-masquerade
flush chain {T} masquerading
flush chain {T} nat-output
flush chain {T} nat-postrouting
flush chain {T} nat-prerouting
flush chain {T} nodeport-endpoints-check
flush chain {T} reject-chain
flush chain {T} services
flush chain {T} service-endpoints-check
add rule {T} cluster-ips-check ip daddr @cluster-ips reject comment "Reject traffic to invalid ports of ClusterIPs"
add rule {T} cluster-ips-check ip daddr {{ {service_cidr} }} drop comment "Drop traffic to unallocated ClusterIPs"
add rule {T} filter-prerouting-pre-dnat ct state new jump firewall-check
add rule {T} filter-forward ct state new jump service-endpoints-check
add rule {T} filter-forward ct state new jump cluster-ips-check
add rule {T} filter-input ct state new jump nodeport-endpoints-check
add rule {T} filter-input ct state new jump service-endpoints-check
add rule {T} filter-output ct state new jump service-endpoints-check
add rule {T} filter-output-pre-dnat ct state new jump firewall-check
add rule {T} filter-output ct state new jump cluster-ips-check
add rule {T} firewall-check ip daddr . meta l4proto . th dport vmap @firewall-ips
add rule {T} mark-for-masquerade mark set mark or 0x4000
add rule {T} masquerading mark and 0x4000 == 0 return
add rule {T} masquerading mark set mark xor 0x4000
add rule {T} masquerading masquerade fully-random
add rule {T} nat-output jump services
add rule {T} nat-postrouting jump masquerading
add rule {T} nat-prerouting jump services
add rule {T} nodeport-endpoints-check ip daddr @nodeport-ips meta l4proto . th dport vmap @no-endpoint-nodeports
add rule {T} reject-chain reject
add rule {T} services ip daddr . meta l4proto . th dport vmap @service-ips
add rule {T} services ip daddr @nodeport-ips meta l4proto . th dport vmap @service-nodeports
add element {T} nodeport-ips {{ {node_ip} }}
add rule {T} service-endpoints-check ip daddr . meta l4proto . th dport vmap @no-endpoint-services
"#
    )
}

/// Where the cluster's pods are (detect-local) and which node this is.
pub struct Env<'a> {
    pub node_name: &'a str,
    pub cluster_cidr: &'a str,
}

/// The whole table: base rules plus every Service.
pub fn full_text(cluster: &Cluster, env: &Env<'_>, service_cidr: &str, node_ip: &str) -> String {
    let mut out = base_text(service_cidr, node_ip);
    let by_service = slices_by_service(&cluster.slices);
    for svc in cluster.services.values() {
        let slices = by_service.get(&svc.name).map(Vec::as_slice).unwrap_or(&[]);
        service_text(&mut out, svc, slices, cluster, env);
    }
    out
}

/// The objects of one Service, as a partial sync that adds it writes them.
pub fn one_service_text(cluster: &Cluster, svc: &Service, env: &Env<'_>) -> String {
    let slices: Vec<&EndpointSlice> = cluster.slices_of(&svc.name).collect();
    let mut out = String::new();
    service_text(&mut out, svc, &slices, cluster, env);
    out
}

fn endpoint_chain(svc: &Service, port: &ServicePort, ep: &PortEndpoint) -> String {
    format!(
        "endpoint-{}",
        hash_and_truncate(&format!(
            "{}/{}/{}/{}__{}/{}",
            svc.name.namespace, svc.name.name, port.protocol, port.name, ep.addr, ep.port
        ))
    )
}

fn vmap_rule(
    out: &mut String,
    chain: &str,
    svc: &Service,
    port: &ServicePort,
    eps: &[PortEndpoint],
) {
    let targets: Vec<String> = eps
        .iter()
        .enumerate()
        .map(|(i, ep)| format!("{i} : goto {}", endpoint_chain(svc, port, ep)))
        .collect();
    let _ = writeln!(
        out,
        "add rule {T} {chain} numgen random mod {} vmap {{ {} }}",
        eps.len(),
        targets.join(" , ")
    );
}

fn service_text(
    out: &mut String,
    svc: &Service,
    slices: &[&EndpointSlice],
    cluster: &Cluster,
    env: &Env<'_>,
) {
    let family = Family::V4;
    let Some(cluster_ip) = svc.cluster_ip(family) else {
        return;
    };
    let topo = NodeTopology {
        node_name: env.node_name,
        zone: cluster.node.as_ref().and_then(|n| n.zone()),
    };
    let external_ips: Vec<_> = svc
        .external_ips
        .iter()
        .chain(&svc.load_balancer_ips)
        .filter(|ip| ip.is_ipv4())
        .collect();
    for port in svc.ports.iter() {
        let proto = port.protocol;
        let p = port.port;
        let comment = format!("{}:{}", svc.name, port.name);
        let base = hash_and_truncate(&format!(
            "{}/{}/{}/{}",
            svc.name.namespace, svc.name.name, proto, port.name
        ));
        let cluster_chain = format!("service-{base}");
        let local_chain = format!("local-{base}");
        let external_chain = format!("external-{base}");
        let eps = port_endpoints(slices, port, family, env.node_name);
        let accessible = svc.externally_accessible(port);
        let usage = Usage::new(
            svc.internal_policy_local,
            svc.external_policy_local,
            accessible,
        );
        let cat = categorize(eps, usage, &topo);
        let _ = writeln!(out, "add element {T} cluster-ips {{ {cluster_ip} }}");
        if !cat.has_any {
            let _ = writeln!(
                out,
                "add element {T} no-endpoint-services {{ {cluster_ip} . {proto} . {p} comment \"{comment}\" : goto reject-chain }}"
            );
            for ip in &external_ips {
                let _ = writeln!(
                    out,
                    "add element {T} no-endpoint-services {{ {ip} . {proto} . {p} comment \"{comment}\" : goto reject-chain }}"
                );
            }
            if let Some(np) = port.node_port {
                let _ = writeln!(
                    out,
                    "add element {T} no-endpoint-nodeports {{ {proto} . {np} comment \"{comment}\" : goto reject-chain }}"
                );
            }
            continue;
        }
        let internal_chain = if svc.internal_policy_local {
            &local_chain
        } else {
            &cluster_chain
        };
        let uses_cluster_chain = usage.uses_cluster && !cat.cluster.is_empty();
        let uses_local_chain = usage.uses_local && !cat.local.is_empty();
        let has_internal = if svc.internal_policy_local {
            uses_local_chain
        } else {
            uses_cluster_chain
        };
        let has_external = if svc.external_policy_local {
            uses_local_chain
        } else {
            uses_cluster_chain
        };
        let mut chains = Vec::new();
        let mut rules = Vec::new();
        if uses_cluster_chain {
            chains.push(cluster_chain.clone());
            if !svc.internal_policy_local {
                rules.push(format!(
                    "add rule {T} {cluster_chain} ip daddr {cluster_ip} ip saddr != {} jump mark-for-masquerade",
                    env.cluster_cidr
                ));
            }
            let mut r = String::new();
            vmap_rule(&mut r, &cluster_chain, svc, port, &cat.cluster);
            rules.push(r.trim_end().to_string());
        }
        if uses_local_chain {
            chains.push(local_chain.clone());
            let mut r = String::new();
            vmap_rule(&mut r, &local_chain, svc, port, &cat.local);
            rules.push(r.trim_end().to_string());
        }
        if accessible {
            chains.push(external_chain.clone());
            if svc.external_policy_local {
                rules.push(format!(
                    "add rule {T} {external_chain} ip saddr {} goto {cluster_chain} comment \"short-circuit pod traffic\"",
                    env.cluster_cidr
                ));
                rules.push(format!(
                    "add rule {T} {external_chain} fib saddr type local jump mark-for-masquerade comment \"masquerade local traffic\""
                ));
                rules.push(format!(
                    "add rule {T} {external_chain} fib saddr type local goto {cluster_chain} comment \"short-circuit local traffic\""
                ));
                if uses_local_chain {
                    rules.push(format!("add rule {T} {external_chain} goto {local_chain}"));
                }
            } else {
                rules.push(format!(
                    "add rule {T} {external_chain} jump mark-for-masquerade"
                ));
                rules.push(format!(
                    "add rule {T} {external_chain} goto {cluster_chain}"
                ));
            }
        }
        for ep in cat.all_reachable() {
            let chain = endpoint_chain(svc, port, ep);
            chains.push(chain.clone());
            rules.push(format!(
                "add rule {T} {chain} ip saddr {} jump mark-for-masquerade",
                ep.addr
            ));
            rules.push(format!(
                "add rule {T} {chain} meta l4proto {proto} dnat to {}:{}",
                ep.addr, ep.port
            ));
        }
        for c in &chains {
            let _ = writeln!(out, "add chain {T} {c}");
            let _ = writeln!(out, "flush chain {T} {c}");
        }
        for r in &rules {
            let _ = writeln!(out, "{r}");
        }
        if has_internal {
            let _ = writeln!(
                out,
                "add element {T} service-ips {{ {cluster_ip} . {proto} . {p} : goto {internal_chain} }}"
            );
        } else {
            let _ = writeln!(
                out,
                "add element {T} no-endpoint-services {{ {cluster_ip} . {proto} . {p} comment \"{comment}\" : drop }}"
            );
        }
        if accessible {
            for ip in &external_ips {
                let _ = writeln!(
                    out,
                    "add element {T} service-ips {{ {ip} . {proto} . {p} : goto {external_chain} }}"
                );
            }
            if let Some(np) = port.node_port {
                let _ = writeln!(
                    out,
                    "add element {T} service-nodeports {{ {proto} . {np} : goto {external_chain} }}"
                );
            }
            if !has_external {
                for ip in &external_ips {
                    let _ = writeln!(
                        out,
                        "add element {T} no-endpoint-services {{ {ip} . {proto} . {p} comment \"{comment}\" : drop }}"
                    );
                }
                if let Some(np) = port.node_port {
                    let _ = writeln!(
                        out,
                        "add element {T} no-endpoint-nodeports {{ {proto} . {np} comment \"{comment}\" : drop }}"
                    );
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synth;

    fn env() -> Env<'static> {
        Env {
            node_name: synth::NODE,
            cluster_cidr: synth::CLUSTER_CIDR_V4,
        }
    }

    #[test]
    fn cluster_ip_service_has_kube_proxy_shape() {
        let cluster = synth::to_cluster(&synth::objects(1, 3)).unwrap();
        let svc = cluster.services.values().next().unwrap();
        let text = one_service_text(&cluster, svc, &env());
        let count = |p: &str| text.lines().filter(|l| l.starts_with(p)).count();
        // 1 service chain + 3 endpoint chains, each added and flushed.
        assert_eq!(count("add chain ip kube-proxy service-"), 1);
        assert_eq!(count("add chain ip kube-proxy endpoint-"), 3);
        assert_eq!(count("flush chain "), 4);
        // masquerade + numgen vmap, 2 rules per endpoint.
        assert_eq!(count("add rule "), 2 + 2 * 3);
        assert_eq!(count("add element "), 2);
        assert!(text.contains("numgen random mod 3 vmap { 0 : goto endpoint-"));
        assert!(
            text.contains("ip daddr 172.16.0.10 ip saddr != 10.0.0.0/8 jump mark-for-masquerade")
        );
        assert!(text.contains(
            "add element ip kube-proxy service-ips { 172.16.0.10 . tcp . 80 : goto service-"
        ));
    }

    #[test]
    fn local_policy_without_local_endpoints_drops_external_traffic() {
        // Service 17: NodePort, externalTrafficPolicy Local, no endpoint on this node.
        let cluster = synth::to_cluster(&synth::objects(20, 5)).unwrap();
        let name = synth::Spec::of(17, 5).object_name();
        let text = one_service_text(&cluster, &cluster.services[&name], &env());
        assert!(text.contains("comment \"short-circuit pod traffic\""));
        assert!(text.contains("no-endpoint-nodeports { tcp . 30003 comment"));
        assert!(!text.contains("local-"));
        // Service 18: the same with a local endpoint: a local- chain and no drop.
        let name = synth::Spec::of(18, 5).object_name();
        let text = one_service_text(&cluster, &cluster.services[&name], &env());
        assert!(text.contains("numgen random mod 1 vmap"));
        assert!(!text.contains("no-endpoint-nodeports"));
    }
}
