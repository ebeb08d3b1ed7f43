#!/usr/bin/env bash
# nftproxy demo: builds a throwaway lab of network namespaces (a node, two pods, a client pod),
# programs examples/cluster.yaml into the node with `nftproxy run --once`, sends real traffic
# through the Services and prints who answered. Everything it creates is removed on exit,
# also on Ctrl-C. Needs root (network namespaces) and socat.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(id -u)" != 0 ]; then
  echo "nftproxy demo needs root: it creates network namespaces and programs nftables in them." >&2
  exit 1
fi
for tool in ip nft socat; do
  command -v "$tool" >/dev/null || { echo "demo: '$tool' is missing (apt-get install iproute2 nftables socat)" >&2; exit 1; }
done

cargo build -q -p nftproxy
bin=target/debug/nftproxy
p="nftpdemo-$$"
node="$p-node"
pids=()
namespaces=()

cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  for ns in "${namespaces[@]}"; do ip netns del "$ns" 2>/dev/null || true; done
}
trap cleanup EXIT
trap 'exit 130' INT TERM

nsx() { local ns=$1; shift; ip netns exec "$ns" "$@"; }

mkns() {
  ip netns add "$1"
  namespaces+=("$1")
  nsx "$1" ip link set lo up
}

mkns "$node"
nsx "$node" sysctl -qw net.ipv4.ip_forward=1 net.ipv6.conf.all.forwarding=1
# The node's uplink leads to a "world" namespace; the node's default route points there, as a
# real node's does (without one, traffic to unknown Service IPs fails in routing).
mkns "$p-world"
ip link add uplink netns "$node" type veth peer name eth0 netns "$p-world"
nsx "$node" ip link set uplink up
nsx "$p-world" ip link set eth0 up
nsx "$node" ip addr add 192.168.0.2/32 dev uplink
nsx "$node" ip route add default dev uplink
nsx "$node" ip -6 addr add 2001:db8::2/128 dev uplink nodad
nsx "$node" ip -6 route add default dev uplink

# pod NAME IPv4 [IPv6]: a namespace behind the node, Calico-style (link-local gateway).
pod() {
  local ns="$p-$1" v4=$2 v6=${3:-}
  mkns "$ns"
  ip link add "$1" netns "$node" type veth peer name eth0 netns "$ns"
  nsx "$node" ip link set "$1" up
  nsx "$node" ip addr add 169.254.1.1/32 dev "$1"
  nsx "$node" ip route add "$v4/32" dev "$1"
  nsx "$ns" ip link set eth0 up
  nsx "$ns" ip addr add "$v4/32" dev eth0
  nsx "$ns" ip route add 169.254.1.1 dev eth0
  nsx "$ns" ip route add default via 169.254.1.1 dev eth0
  if [ -n "$v6" ]; then
    nsx "$node" ip -6 addr add fe80::1/64 dev "$1" nodad
    nsx "$node" ip -6 route add "$v6/128" dev "$1"
    nsx "$ns" ip -6 addr add "$v6/128" dev eth0 nodad
    nsx "$ns" ip -6 route add default via fe80::1 dev eth0
  fi
}

echo_server() { # namespace, socat listen spec
  local ns=$1 spec=$2
  nsx "$ns" socat "$spec,fork,reuseaddr" SYSTEM:'echo "$SOCAT_SOCKADDR answered $SOCAT_PEERADDR"' &
  pids+=($!)
}

pod pod-a 10.180.0.11 fd00:10:180::11
pod pod-b 10.180.0.12
pod client 10.180.0.100 fd00:10:180::100
for ns in "$p-pod-a" "$p-pod-b"; do
  echo_server "$ns" TCP-LISTEN:8080
done
echo_server "$p-pod-a" UDP4-RECVFROM:53
echo_server "$p-pod-a" TCP4-LISTEN:53
echo_server "$p-pod-a" UDP6-RECVFROM:53
sleep 0.5

cat > "/tmp/$p-config.yaml" <<EOF
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clusterCIDR: 10.180.0.0/16,fd00:10:180::/64
hostnameOverride: demo-node
EOF
trap 'rm -f "/tmp/$p-config.yaml"; cleanup' EXIT

echo "== programming examples/cluster.yaml into namespace $node"
nsx "$node" "$bin" run --once --from-file examples/cluster.yaml --config "/tmp/$p-config.yaml"

ask() { # description, socat address
  local out
  out=$(echo hello | nsx "$p-client" timeout 2 socat -T1 - "$2" 2>&1 | head -1 || true)
  [ -n "$out" ] || out="(no answer)"
  printf '  %-36s %s\n' "$1" "$out"
}

echo
echo "== demo/web (ClusterIP 172.30.0.10:80, two endpoints), 6 connections from the client pod"
for _ in 1 2 3 4 5 6; do ask "tcp 172.30.0.10:80" TCP4:172.30.0.10:80; done
echo "== demo/dns (dual-stack), UDP and TCP"
ask "udp 172.30.0.53:53" UDP4:172.30.0.53:53
ask "tcp 172.30.0.53:53" TCP4:172.30.0.53:53
ask "udp [fd00:172:30::53]:53" 'UDP6:[fd00:172:30::53]:53'
echo "== demo/empty (no endpoints): rejected"
ask "tcp 172.30.0.20:80" TCP4:172.30.0.20:80
echo
echo "== what nftproxy programmed: nft list table ip nftproxy (service chains)"
nsx "$node" nft list table ip nftproxy | grep -A4 'chain service-' | sed 's/^/  /'
