#!/usr/bin/env python3
"""Kernel experiments for a flat path for every Service shape (issue 20 item 2).

Measures, with `nft -f` scripts in a network namespace of its own (deleted on exit), what it
costs nf_tables to change the endpoints of Services with more than 16 endpoints at 100k
Services, for three shapes of a shared endpoint structure, and checks spread and affinity with
traffic. docs/performance.md ("A flat path for large Services: kernel experiments") has the
figures and what they mean. Run as root:

    scripts/flat-path-experiment.py hash      # shared hash map, rejection sampling
    scripts/flat-path-experiment.py rbtree    # one interval map, 16-byte key (rbtree backend)
    scripts/flat-path-experiment.py pipapo    # one concatenated interval map (pipapo backend)
    scripts/flat-path-experiment.py spread    # 1,000 endpoints, 300k connections: chi-square
    scripts/flat-path-experiment.py affinity  # shared ClientIP affinity map, with traffic
    scripts/flat-path-experiment.py affinity-checked  # the same, entries checked (raw netlink)
    scripts/flat-path-experiment.py latency   # cost of a new connection per Service shape
    scripts/flat-path-experiment.py grow      # 1 -> 200 -> 1 endpoints under probes
    scripts/flat-path-experiment.py floor     # kernel time of 1,000 / 5,000 elements, cheapest first

The kernel time of a change is the time nft spends in sendmsg(2) for its batch (strace -T):
nf_tables processes and commits the whole batch inside that call. nft's own time (its cache
of an interval map's elements takes minutes at this size) is not part of it.
"""

import json
import math
import os
import random
import re
import subprocess
import sys
import tempfile

SERVICES = 100_000
M_INTERVALS = 2_882_880  # divisible by every k <= 16, as the endpoint maps' regions
CLASSES = range(5, 14)  # moduli 2^5 .. 2^13: Services of 17 .. 8,192 endpoints
ATTEMPTS = 20  # draws per class chain; all miss with probability < 2^-20
EP0 = (10 << 24) | (128 << 16)
NEW_VIP = (10 << 24) | (200 << 16)
NEW_EP = 3_000_000


def ip(n):
    return ".".join(str((n >> s) & 255) for s in (24, 16, 8, 0))


def cluster():
    """(VIP, endpoints, first endpoint index) per Service, heavy-tailed like the bench's
    realistic shape: 2% none, 43% one, 20% two, 10% three, 18% 4-16, 6.5% 17-99, 0.5%
    100-999, one in 2,000 1,000-5,000."""
    rnd = random.Random(7)
    out, ep = [], 0
    for i in range(SERVICES):
        r = rnd.random()
        if i % 2000 == 999:
            k = rnd.randint(1000, 5000)
        elif r < 0.02:
            k = 0
        elif r < 0.45:
            k = 1
        elif r < 0.65:
            k = 2
        elif r < 0.75:
            k = 3
        elif r < 0.93:
            k = rnd.randint(4, 16)
        elif r < 0.995:
            k = int(math.exp(rnd.uniform(math.log(17), math.log(100))))
        else:
            k = int(math.exp(rnd.uniform(math.log(100), math.log(1000))))
        out.append(((10 << 24) | (96 << 16) | i, k, ep))
        ep += k
    return out


def class_of(k):
    return next(j for j in CLASSES if k <= 1 << j)


# --- element texts ---------------------------------------------------------------------------


def hash_elems(vip, n, e0, proto="tcp"):
    return [f"{ip(vip)} . {proto} . 80 . {i} : {ip(EP0 + e0 + i)} . 8080" for i in range(n)]


def hash_keys(vip, n, lo=0):
    return [f"{ip(vip)} . tcp . 80 . {i}" for i in range(lo, n)]


def rb_key(vip, u):
    """The 16 bytes the rule `ip daddr . meta l4proto . th dport . numgen random mod 2^24`
    leaves in its registers on a little-endian host, written as an IPv6 address (the rbtree
    backend compares keys with memcmp). numgen's value is host-endian, so its bytes are
    (u >> 16, u >> 8, u, 0) for the u-th key in memcmp order: equal ranges of u are equal
    odds."""
    b = [(vip >> s) & 255 for s in (24, 16, 8, 0)] + [6, 0, 0, 0, 0, 80, 0, 0]
    b += [(u >> 16) & 255, (u >> 8) & 255, u & 255, 0]
    return ":".join(f"{b[i]:02x}{b[i + 1]:02x}" for i in range(0, 16, 2))


def rb_ranges(vip, n):
    u = 1 << 24
    return [f"{rb_key(vip, i * u // n)}-{rb_key(vip, (i + 1) * u // n - 1)}" for i in range(n)]


def rb_elems(vip, n, e0):
    return [f"{r} : {ip(EP0 + e0 + i)} . 8080" for i, r in enumerate(rb_ranges(vip, n))]


def pp_ranges(vip, n):
    m = M_INTERVALS
    return [f"{ip(vip)} . tcp . 80 . {i * m // n}-{(i + 1) * m // n - 1}" for i in range(n)]


def pp_elems(vip, n, e0):
    return [f"{r} : {ip(EP0 + e0 + i)} . 8080" for i, r in enumerate(pp_ranges(vip, n))]


def add(set_, elems, chunk=20000):
    return "".join(
        f"add element ip t {set_} {{ {', '.join(elems[c:c + chunk])} }}\n"
        for c in range(0, len(elems), chunk)
    )


def delete(set_, keys):
    return f"delete element ip t {set_} {{ {', '.join(keys)} }}\n" if keys else ""


# --- the table -------------------------------------------------------------------------------


def base_table(hook="type nat hook prerouting priority dstnat"):
    """The flat lists as today (cluster-endpoints-1..16), plus the three candidate structures
    for larger Services: the hash map with its class sets and class chains, an interval map
    with a 16-byte key (rbtree, unbound: nft cannot write the rule that uses it), and a
    concatenated interval map (pipapo)."""
    w = ["table ip t {"]
    typeof = "typeof ip daddr . meta l4proto . th dport . numgen random mod 2 : ip daddr . th dport"
    for k in range(1, 17):
        w.append(f" map cluster-endpoints-{k} {{ {typeof} ; size 786432 ; }}")
    w.append(f" map big-endpoints {{ {typeof} ; size 1572864 ; }}")
    w.append(" map big-fallback { typeof ip daddr . meta l4proto . th dport : ip daddr . th dport ; size 24576 ; }")
    for j in CLASSES:
        w.append(f" set big-class-{j} {{ typeof ip daddr . meta l4proto . th dport ; size 24576 ; }}")
    w.append(f" map big-pipapo {{ {typeof} ; flags interval ; }}")
    w.append(" map big-rbtree { type ipv6_addr : ipv4_addr . inet_service ; flags interval ; }")
    key = "ip daddr . meta l4proto . th dport"
    for j in CLASSES:
        w += class_chains(j)
    w.append(f" chain pre {{ {hook} ;")
    for k in range(1, 17):
        w.append(f"  dnat ip to {key} . numgen random mod {k} map @cluster-endpoints-{k}")
    for j in CLASSES:
        w.append(f"  {key} @big-class-{j} goto big-{j}")
    w.append(f"  meta l4proto tcp dnat ip to {key} . numgen random mod {M_INTERVALS} map @big-pipapo")
    w.append(" }\n}\n")
    return "\n".join(w)


def class_chains(j):
    """Chain big-J draws up to ATTEMPTS times from [0, 2^J) through chain draw-J, whose one
    rule is the only user of big-endpoints for class J: the kernel checks an added map element
    against every rule that uses its map (180 rules with the draws inline: 2.6 us per element
    instead of 0.7)."""
    key = "ip daddr . meta l4proto . th dport"
    return ([f" chain draw-{j} {{", f"  dnat ip to {key} . numgen random mod {1 << j} map @big-endpoints", " }",
             f" chain big-{j} {{"] + [f"  jump draw-{j}"] * ATTEMPTS
            + [f"  dnat ip to {key} map @big-fallback", " }"])


def lists(svcs):
    return "".join(
        add(f"cluster-endpoints-{k}", [e for s in svcs if s[1] == k for e in hash_elems(*s)])
        for k in range(1, 17)
    )


def hash_big(svcs):
    big = [s for s in svcs if s[1] > 16]
    out = add("big-endpoints", [e for s in big for e in hash_elems(*s)])
    for j in CLASSES:
        members = [f"{ip(v)} . tcp . 80" for v, n, _ in big if class_of(n) == j]
        out += add(f"big-class-{j}", members)
    out += add("big-fallback", [f"{ip(v)} . tcp . 80 : {ip(EP0 + e0)} . 8080" for v, _, e0 in big])
    return out


# --- running ---------------------------------------------------------------------------------


class Netns:
    def __init__(self):
        self.name = f"flat-exp-{os.getpid()}-x"

    def __enter__(self):
        subprocess.run(["ip", "netns", "add", self.name], check=True)
        return self

    def __exit__(self, *exc):
        subprocess.run(["ip", "netns", "del", self.name], check=False)

    def run(self, *cmd, check=True, **kw):
        return subprocess.run(["ip", "netns", "exec", self.name, *cmd], check=check, **kw)

    def sh(self, script):
        self.run("sh", "-ec", script)

    def nft(self, text, label, quiet=False):
        """Loads text with nft -f; returns the kernel time of its batch in ms."""
        with tempfile.NamedTemporaryFile("w", suffix=".nft") as f, tempfile.NamedTemporaryFile() as t:
            f.write(text)
            f.flush()
            r = self.run("strace", "-f", "-T", "-e", "trace=sendmsg", "-o", t.name, "nft", "-f", f.name,
                         check=False, capture_output=True, text=True)
            ms = sum(float(x) for x in re.findall(r"<([0-9.]+)>", open(t.name).read())) * 1000
        status = "ok" if r.returncode == 0 else "FAILED: " + r.stderr.strip().splitlines()[0][:100]
        if not quiet:
            print(f"  {label:<44} kernel {ms:9.3f} ms  {status}", flush=True)
        return ms


def kernel_mem_kib():
    info = dict(line.split(":", 1) for line in open("/proc/meminfo"))
    return sum(int(info[k].split()[0]) for k in ("Slab", "VmallocUsed"))


def loaded(ns, label, text):
    m0 = kernel_mem_kib()
    ns.nft(text, label)
    print(f"  {'':<44} kernel memory +{(kernel_mem_kib() - m0) / 1024:.0f} MiB (Slab + vmalloc)")


def pairs(ns, reps, *steps):
    for _ in range(reps):
        for label, text in steps:
            ns.nft(text, label)


def run_hash(ns, svcs):
    loaded(ns, "lists (Services of 1-16 endpoints)", lists(svcs))
    loaded(ns, "hash: Services of 17-5,000 endpoints", hash_big(svcs))
    vip, n, e0 = next(s for s in svcs if s[1] == 20)
    v32, _, e32 = next(s for s in svcs if s[1] == 32)
    k = f"{ip(vip)} . tcp . 80"
    pairs(ns, 5,
          ("endpoint added (20 -> 21)", add("big-endpoints", [f"{k} . 20 : {ip(EP0 + NEW_EP)} . 8080"])),
          ("endpoint removed (21 -> 20)", delete("big-endpoints", [f"{k} . 20"])))
    # Removing endpoint 3 of 20: slot 3 gets the last endpoint, the last slot goes.
    pairs(ns, 5,
          ("endpoint 3 removed (last one moves to slot 3)",
           delete("big-endpoints", [f"{k} . 3", f"{k} . 19"]) + add("big-endpoints", [f"{k} . 3 : {ip(EP0 + e0 + 19)} . 8080"])),
          ("endpoint 3 back",
           delete("big-endpoints", [f"{k} . 3"]) + add("big-endpoints", [f"{k} . 3 : {ip(EP0 + e0 + 3)} . 8080", f"{k} . 19 : {ip(EP0 + e0 + 19)} . 8080"])))
    k32 = f"{ip(v32)} . tcp . 80"
    pairs(ns, 5,
          ("class boundary crossed (32 -> 33 endpoints)",
           add("big-endpoints", [f"{k32} . 32 : {ip(EP0 + NEW_EP)} . 8080"]) + delete("big-class-5", [k32]) + add("big-class-6", [k32])),
          ("class boundary crossed (33 -> 32 endpoints)",
           delete("big-endpoints", [f"{k32} . 32"]) + delete("big-class-6", [k32]) + add("big-class-5", [k32])))
    v16, _, e16 = next(s for s in svcs if s[1] == 16)
    k16 = f"{ip(v16)} . tcp . 80"
    pairs(ns, 5,
          ("list to hash (16 -> 17 endpoints)",
           delete("cluster-endpoints-16", hash_keys(v16, 16)) + add("big-endpoints", hash_elems(v16, 17, e16))
           + add("big-class-5", [k16]) + add("big-fallback", [f"{k16} : {ip(EP0 + e16)} . 8080"])),
          ("hash to list (17 -> 16 endpoints)",
           delete("big-endpoints", hash_keys(v16, 17)) + delete("big-class-5", [k16]) + delete("big-fallback", [k16])
           + add("cluster-endpoints-16", hash_elems(v16, 16, e16))))
    # For comparison: the same number of elements in today's lists (1,000 one-endpoint Services).
    ones = [(NEW_VIP + 1 + i, 1, NEW_EP + i) for i in range(1000)]
    pairs(ns, 5,
          ("1,000 Services of 1 endpoint added (lists)", add("cluster-endpoints-1", [e for s in ones for e in hash_elems(*s)])),
          ("1,000 Services of 1 endpoint deleted", delete("cluster-endpoints-1", [k for v, _, _ in ones for k in hash_keys(v, 1)])))
    for n in (20, 1000, 5000):
        kn = f"{ip(NEW_VIP)} . tcp . 80"
        pairs(ns, 5,
              (f"Service added ({n} endpoints)",
               add(f"big-class-{class_of(n)}", [kn]) + add("big-fallback", [f"{kn} : {ip(EP0 + NEW_EP)} . 8080"])
               + add("big-endpoints", hash_elems(NEW_VIP, n, NEW_EP))),
              (f"Service deleted ({n} endpoints)",
               delete(f"big-class-{class_of(n)}", [kn]) + delete("big-fallback", [kn]) + delete("big-endpoints", hash_keys(NEW_VIP, n))))


def run_rbtree(ns, svcs):
    big = [s for s in svcs if s[1] > 16]
    loaded(ns, "rbtree: Services of 17-5,000 endpoints", add("big-rbtree", [e for s in big for e in rb_elems(*s)]))
    vip, n, e0 = next(s for s in svcs if s[1] == 20)
    pairs(ns, 2,
          ("endpoint added (20 -> 21 intervals)", delete("big-rbtree", rb_ranges(vip, 20)) + add("big-rbtree", rb_elems(vip, 21, e0))),
          ("endpoint removed (21 -> 20 intervals)", delete("big-rbtree", rb_ranges(vip, 21)) + add("big-rbtree", rb_elems(vip, 20, e0))))
    pairs(ns, 1,
          ("Service added (20 endpoints)", add("big-rbtree", rb_elems(NEW_VIP, 20, NEW_EP))),
          ("Service deleted (20 endpoints)", delete("big-rbtree", rb_ranges(NEW_VIP, 20))))


def run_pipapo(ns, svcs):
    # nft 1.0.6 writes numgen's range bounds in host byte order while pipapo compares them as
    # big-endian: a range whose low byte wraps (2298877-2302252) fails with EINVAL, the
    # others match other values than written. Changes on an (almost) empty map still show
    # what a pipapo commit costs.
    vip, n, e0 = next(s for s in svcs if s[1] > 16 and s[1] < 60)
    pairs(ns, 3,
          (f"Service added ({n} endpoints), map empty", add("big-pipapo", pp_elems(vip, n, e0))),
          (f"Service deleted ({n} endpoints)", delete("big-pipapo", pp_ranges(vip, n))))
    pairs(ns, 2,
          ("Service added (1000 endpoints), map empty", add("big-pipapo", pp_elems(NEW_VIP, 1000, NEW_EP))),
          ("Service deleted (1000 endpoints)", delete("big-pipapo", pp_ranges(NEW_VIP, 1000))))
    big = [s for s in svcs if s[1] > 16]
    loaded(ns, "pipapo: first 3,000 intervals", add("big-pipapo", [e for s in big for e in pp_elems(*s)][:3000]))


def traffic_ns(ns, sources):
    ns.sh(f"""ip link set lo up
ip link add d0 type veth peer name d1; ip link set d0 up; ip link set d1 up
for a in $(seq 1 {sources}); do ip addr add 192.168.7.$a/24 dev d0; done
ip neigh add 192.168.7.254 lladdr 02:00:00:00:00:01 dev d0
for n in 10.96.0.0/12 10.128.0.0/9 10.200.0.0/16; do ip route add $n via 192.168.7.254 dev d0; done""")


SEND = """
import socket, sys
vip, clients, per, port0 = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
for c in range(1, clients + 1):
    for p in range(port0, port0 + per):
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.bind(("192.168.7.%d" % c, p)); s.sendto(b"x", (vip, 80)); s.close()
"""


def send(ns, vip, clients, per, port0=10000):
    ns.run(sys.executable, "-c", SEND, vip, str(clients), str(per), str(port0))


def seen(ns):
    """Packets per (client, endpoint) from the `seen` set's counters."""
    out = json.loads(ns.run("nft", "-j", "list", "set", "ip", "t", "seen", capture_output=True, text=True).stdout)
    counts = {}
    for x in out["nftables"]:
        for e in x.get("set", {}).get("elem", []):
            c, ep = e["elem"]["val"]["concat"]
            counts[(c, ep)] = e["elem"]["counter"]["packets"]
    return counts


def udp_table(n, j, extra_maps="", extra_rules="", post_nat=""):
    key = "ip daddr . meta l4proto . th dport"
    chains = "\n".join(class_chains(j))
    return f"""table ip t {{
 map big-endpoints {{ typeof {key} . numgen random mod 2 : ip daddr . th dport ; size 12288 ; }}
 map big-fallback {{ typeof {key} : ip daddr . th dport ; }}
 set big-class-{j} {{ typeof {key} ; elements = {{ 10.96.0.10 . udp . 80 }} ; }}
 set seen {{ typeof ip saddr . ip daddr ; flags dynamic ; size 65536 ; }}
{extra_maps}
{chains}
 chain out {{ type nat hook output priority -100 ;
{extra_rules}
  {key} @big-class-{j} goto big-{j}
 }}
 chain post-nat {{ type nat hook postrouting priority 100 ;
{post_nat}
 }}
 chain post {{ type filter hook postrouting priority 100 ;
  udp dport 8080 add @seen {{ ip saddr . ip daddr counter }}
 }}
}}
{add("big-endpoints", hash_elems((10 << 24) | (96 << 16) | 10, n, 0, "udp"))}
add element ip t big-fallback {{ 10.96.0.10 . udp . 80 : {ip(EP0)} . 8080 }}
"""


def run_spread(ns, _svcs):
    traffic_ns(ns, 10)
    ns.nft(udp_table(1000, 10), "1,000 endpoints, class 2^10", quiet=True)
    send(ns, "10.96.0.10", 10, 30000)
    per_ep = {}
    for (_, ep), k in seen(ns).items():
        per_ep[ep] = per_ep.get(ep, 0) + k
    c = list(per_ep.values())
    mean = sum(c) / len(c)
    chi2 = sum((x - mean) ** 2 / mean for x in c)
    sd = (sum((x - mean) ** 2 for x in c) / len(c)) ** 0.5
    print(f"  {sum(c)} new connections to a 1,000-endpoint Service: {len(c)} endpoints hit, "
          f"min {min(c)} max {max(c)} mean {mean:.1f} sd {sd:.1f} (binomial {math.sqrt(mean * (1 - 1 / len(c))):.1f}), "
          f"chi-square {chi2:.0f} on {len(c) - 1} degrees of freedom")


# Raw nf_tables netlink, for the two rules nft's syntax cannot write: a map's result used as
# part of a second lookup's key (the affinity entry checked against the Service's endpoints),
# and a dynset delete on a map.
def nla(kind, payload):
    import struct
    return struct.pack("=HH", 4 + len(payload), kind) + payload + b"\0" * (-len(payload) % 4)


def nest(kind, *attrs):
    return nla(kind | 0x8000, b"".join(attrs))


def be32(kind, v):
    import struct
    return nla(kind, struct.pack(">I", v))


def expr(name, *attrs):
    return nest(1, nla(1, name.encode() + b"\0"), nest(2, *attrs))


def payload(dreg, base, offset, length):
    return expr("payload", be32(1, dreg), be32(2, base), be32(3, offset), be32(4, length))


def meta_l4proto(dreg):
    return expr("meta", be32(1, dreg), be32(2, 16))


def ct_original(dreg, key):  # key 20: dst_ip, 12: proto_dst
    return expr("ct", be32(1, dreg), be32(2, key), nla(3, b"\0"))


def lookup(set_, sreg, dreg=None, invert=False):
    attrs = [nla(1, set_.encode() + b"\0"), be32(2, sreg)] + ([be32(3, dreg)] if dreg else [])
    return expr("lookup", *attrs, *([be32(5, 1)] if invert else []))


RAW_RULES = """
import socket, struct, sys
def msg(kind, flags, family, body, seq):
    return struct.pack("=IHHII", 20 + len(body), kind, flags, seq, 0) + struct.pack("=BBH", family, 0, socket.htons(10)) + body
rules = [bytes.fromhex(h) for h in sys.argv[1:]]
batch = msg(16, 1, 0, b"", 1)
for i, r in enumerate(rules):
    batch += msg((10 << 8) | 6, 1 | 4 | 0x400 | 0x800, 2, r, 2 + i)
batch += msg(17, 1, 0, b"", 2 + len(rules))
s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 12)
s.send(batch)
s.settimeout(1)
for _ in rules:
    data = s.recv(65536)
    err = struct.unpack("=i", data[16:20])[0]
    if err:
        sys.exit("netlink error %d" % err)
"""


def raw_rules(ns, *rules):
    """Appends rules ((table, chain, expressions)) in one batch."""
    hexes = [(nla(1, b"t\0") + nla(2, c.encode() + b"\0") + nest(4, *e)).hex() for c, e in rules]
    ns.run(sys.executable, "-c", RAW_RULES, *hexes)


def run_affinity(ns, _svcs, checked=False):
    traffic_ns(ns, 10)
    key = "ip daddr . meta l4proto . th dport"
    orig = "ct original ip daddr . meta l4proto . ct original proto-dst"
    ns.nft(udp_table(
        100, 7,
        extra_maps=(f" set affinity-services-10800 {{ typeof {key} ; elements = {{ 10.96.0.10 . udp . 80 }} ; }}\n"
                    f" map affinity-10800 {{ typeof ip saddr . {key} : ip daddr . th dport ; flags dynamic,timeout ; timeout 10800s ; size 65536 ; }}\n"
                    f" set service-endpoints {{ typeof {key} . ip daddr . th dport ; size 12288 ; }}\n"
                    " chain affinity-checked { }\n chain affinity-stale { }"),
        extra_rules=("  jump affinity-checked" if checked else
                     f"  meta l4proto udp dnat ip to ip saddr . {key} map @affinity-10800"),
        post_nat=("  jump affinity-stale\n" if checked else "") +
                 (f"  meta l4proto udp ct status dnat {orig} @affinity-services-10800 "
                  f"update @affinity-10800 {{ ip saddr . {orig} : ip daddr . th dport }}"),
    ), "affinity", quiet=True)
    k = "10.96.0.10 . udp . 80"
    ns.nft(add("service-endpoints", [f"{k} . {ip(EP0 + i)} . 8080" for i in range(100)]), "endpoints", quiet=True)
    if checked:
        # Registers 8-11: client, destination, protocol, port; the affinity entry's endpoint
        # lands in 12-13, so 9-13 is the key of service-endpoints.
        raw_rules(ns,
                  ("affinity-checked", [payload(8, 1, 12, 4), payload(9, 1, 16, 4), meta_l4proto(10),
                                        payload(11, 2, 2, 2), lookup("affinity-10800", 8, 12),
                                        lookup("service-endpoints", 9),
                                        expr("nat", be32(1, 1), be32(2, 2), be32(3, 12), be32(5, 13))]),
                  ("affinity-stale", [payload(8, 1, 12, 4), ct_original(9, 20), meta_l4proto(10), ct_original(11, 12),
                                      lookup("affinity-10800", 8, 12), lookup("service-endpoints", 9, invert=True),
                                      expr("dynset", nla(1, b"affinity-10800\0"), be32(3, 2), be32(4, 8), be32(5, 12))]))
        for chain in ("affinity-checked", "affinity-stale"):
            r = ns.run("nft", "list", "chain", "ip", "t", chain, check=False, capture_output=True, text=True)
            shown = [line.strip() for line in r.stdout.splitlines() if "@" in line]
            print(f"  nft list chain {chain}: " + (f"{shown}" if r.returncode == 0 else f"nft fails ({r.returncode})"))
    send(ns, "10.96.0.10", 10, 50)
    by = {}
    for (c, ep), k in seen(ns).items():
        by.setdefault(c, {})[ep] = k
    print(f"  10 clients x 50 connections to a 100-endpoint Service: endpoints per client "
          f"{sorted(len(v) for v in by.values())}, distinct endpoints {len({e for v in by.values() for e in v})}")
    c1 = next(iter(by["192.168.7.1"]))
    slot = int(c1.split(".")[3]) - 1
    k = "10.96.0.10 . udp . 80"
    ns.nft(delete("big-endpoints", [f"{k} . {slot}", f"{k} . 99"]) + add("big-endpoints", [f"{k} . {slot} : {ip(EP0 + 99)} . 8080"])
           + delete("service-endpoints", [f"{k} . {c1} . 8080"]), "remove client 1's endpoint", quiet=True)
    ns.run("nft", "flush", "set", "ip", "t", "seen")
    send(ns, "10.96.0.10", 1, 50, port0=20000)
    after = sorted({ep for (_, ep) in seen(ns)})
    print(f"  after removing its endpoint {c1} from the Service, client 192.168.7.1's next 50 "
          f"connections go to {after}")


GROW = r"""
import socket, subprocess, sys, threading, time
steps = [t for t in sys.argv[1].split("\x1e")]
server = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
server.bind(("0.0.0.0", 8080))
def echo():
    while True:
        data, peer = server.recvfrom(64)
        server.sendto(data, peer)
threading.Thread(target=echo, daemon=True).start()
done, sent, lost, step, where = False, 0, 0, 0, []
def probe():
    global sent, lost
    port = 20000
    while not done:
        c = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        c.bind(("192.168.7.1", port)); port = 20000 + (port - 19999) % 40000
        c.settimeout(0.5)
        c.sendto(b"p", ("10.96.0.10", 80))
        sent += 1
        try:
            c.recv(64)
        except socket.timeout:
            lost += 1
            where.append(step)
        c.close()
subprocess.run(["nft", "-f", "-"], input=steps[0], text=True, check=True)
t = threading.Thread(target=probe); t.start()
for step, text in enumerate(steps[1:], 1):
    subprocess.run(["nft", "-f", "-"], input=text, text=True, check=True)
    time.sleep(0.02)
done = True; t.join()
print(f"  {len(steps) - 1} changes (1 -> 200 -> 1 endpoints, one at a time), {sent} probes, {lost} lost" + (f" (during changes {where})" if where else ""))
"""


def grow_steps():
    """nft scripts taking a UDP Service from 1 endpoint to 200 and back, one endpoint per
    transaction: lists up to 16 (the list moves to the next length's map), then the hash map
    (one key per change, plus the class-set element when a power of two is crossed)."""
    vip = (10 << 24) | (96 << 16) | 10
    k = f"{ip(vip)} . udp . 80"

    def elems(n):
        return hash_elems(vip, n, 0, "udp")

    def keys(n):
        return [f"{k} . {i}" for i in range(n)]

    def place(n):  # the elements that hold a Service of n endpoints
        if n <= 16:
            return add(f"cluster-endpoints-{n}", elems(n))
        return (add("big-endpoints", elems(n)) + add(f"big-class-{class_of(n)}", [k])
                + add("big-fallback", [f"{k} : {ip(EP0)} . 8080"]))

    def unplace(n):
        if n <= 16:
            return delete(f"cluster-endpoints-{n}", keys(n))
        return delete("big-endpoints", keys(n)) + delete(f"big-class-{class_of(n)}", [k]) + delete("big-fallback", [k])

    def step(n, m):  # n -> m = n +- 1 endpoints
        if n <= 16 or m <= 16:
            return unplace(n) + place(m)
        text = (add("big-endpoints", [elems(m)[n]]) if m > n else delete("big-endpoints", [f"{k} . {m}"]))
        if class_of(n) != class_of(m):
            text += delete(f"big-class-{class_of(n)}", [k]) + add(f"big-class-{class_of(m)}", [k])
        return text

    counts = list(range(1, 201)) + list(range(199, 0, -1))
    return [place(1)] + [step(a, b) for a, b in zip(counts, counts[1:])]


def run_grow(ns, _svcs):
    traffic_ns(ns, 1)
    ns.sh("for i in $(seq 0 199); do ip addr add 10.128.0.$i/32 dev lo; done")
    ns.nft(base_table("type nat hook output priority -100"), "table", quiet=True)
    ns.run(sys.executable, "-c", GROW, "\x1e".join(grow_steps()))


BURST_C = r"""
#include <arpa/inet.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>
int main(int argc, char **argv) {
  int n = atoi(argv[2]);
  struct sockaddr_in dst = {.sin_family = AF_INET, .sin_port = htons(80)};
  inet_pton(AF_INET, argv[1], &dst.sin_addr);
  struct timespec a, b;
  clock_gettime(CLOCK_MONOTONIC, &a);
  for (int i = 0; i < n; i++) {
    int s = socket(AF_INET, SOCK_DGRAM, 0);
    struct sockaddr_in src = {.sin_family = AF_INET, .sin_port = htons(10000 + i % 50000)};
    char addr[32];
    snprintf(addr, sizeof addr, "192.168.7.%d", 1 + i / 50000);
    inet_pton(AF_INET, addr, &src.sin_addr);
    if (bind(s, (void *)&src, sizeof src) || sendto(s, "x", 1, 0, (void *)&dst, sizeof dst) != 1) return 1;
    close(s);
  }
  clock_gettime(CLOCK_MONOTONIC, &b);
  printf("%.3f\n", ((b.tv_sec - a.tv_sec) * 1e9 + (b.tv_nsec - a.tv_nsec)) / 1e3 / n);
  return 0;
}
"""


def run_latency(ns, svcs):
    traffic_ns(ns, 1)
    ns.nft(base_table("type nat hook output priority -100"), "table", quiet=True)
    ns.nft(lists(svcs) + hash_big(svcs), "100k Services", quiet=True)
    shapes = [("10.200.0.3", 3, None), ("10.200.0.16", 16, None), ("10.200.1.3", 17, 5),
              ("10.200.1.2", 4097, 13), ("10.200.1.1", 5000, 13), ("10.200.9.9", 0, None)]
    text = ""
    for vip, n, j in shapes:
        v = int.from_bytes(bytes(int(x) for x in vip.split(".")), "big")
        if n and j is None:
            text += add(f"cluster-endpoints-{n}", hash_elems(v, n, NEW_EP, "udp"))
        elif n:
            text += add("big-endpoints", hash_elems(v, n, NEW_EP, "udp")) + add(f"big-class-{j}", [f"{vip} . udp . 80"])
            text += add("big-fallback", [f"{vip} . udp . 80 : {ip(EP0 + NEW_EP)} . 8080"])
    ns.nft(text, "probe Services", quiet=True)
    with tempfile.TemporaryDirectory() as d:
        subprocess.run(["cc", "-O2", "-o", f"{d}/burst", "-x", "c", "-"], input=BURST_C, text=True, check=True)
        best = {}
        for _ in range(6):
            for vip, n, _ in shapes:
                ns.run("conntrack", "-F", check=False, capture_output=True)
                us = float(ns.run(f"{d}/burst", vip, "50000", capture_output=True, text=True).stdout)
                best.setdefault(n, []).append(us)
    for vip, n, j in shapes:
        shape = "no Service" if not n else (f"list of {n}" if j is None else f"{n} endpoints, class 2^{j}")
        print(f"  {shape:<28} new UDP connection: best of 6 {min(best[n]):6.1f} us, median {sorted(best[n])[3]:6.1f} us")


def run_floor(ns, _svcs):
    """What adding and deleting n elements costs the kernel, from the cheapest element there is
    (a 4-byte key, no data, in a hash of fixed size) to the flat path's map at 100k. Every
    endpoint a rule can send a connection to is at least one such object: nft can use a map's
    data only whole (`dnat to ... map`), so one element carries one endpoint."""
    shapes = [
        ("s-fixed", "set s-fixed { type ipv4_addr; size 65536; }",
         lambda i: ip(EP0 + i), lambda i: ip(EP0 + i)),
        ("s-resizable", "set s-resizable { type ipv4_addr; }",
         lambda i: ip(EP0 + i), lambda i: ip(EP0 + i)),
        ("m-small", "map m-small { typeof ip daddr . meta l4proto . th dport . numgen random mod 2 : "
         "ip daddr . th dport; size 12288; }",
         lambda i: f"{ip(NEW_VIP)} . tcp . 80 . {i} : {ip(EP0 + i)} . 8080",
         lambda i: f"{ip(NEW_VIP)} . tcp . 80 . {i}"),
        ("m-100k", "map m-100k { typeof ip daddr . meta l4proto . th dport . numgen random mod 2 : "
         "ip daddr . th dport; size 3145728; }",
         lambda i: f"{ip(NEW_VIP)} . tcp . 80 . {i} : {ip(EP0 + i)} . 8080",
         lambda i: f"{ip(NEW_VIP)} . tcp . 80 . {i}"),
    ]
    ns.nft("table ip t {\n" + "\n".join(decl for _, decl, _, _ in shapes) + "\n}\n", "table", quiet=True)
    labels = {"s-fixed": "ipv4_addr set, size 65536 (fixed hash)",
              "s-resizable": "ipv4_addr set, no size (rhashtable)",
              "m-small": "flat-path map, size 12288",
              "m-100k": "flat-path map, size 3145728 (as at 100k)"}
    for name, _, elem, key in shapes:
        for n in (1000, 5000):
            added, deleted = [], []
            for _ in range(6):
                added.append(ns.nft(add(name, [elem(i) for i in range(n)]), "", quiet=True))
                deleted.append(ns.nft(delete(name, [key(i) for i in range(n)]), "", quiet=True))
            print(f"  {labels[name]:<44} {n:>5} added {min(added):6.2f}-{max(added):6.2f} ms, "
                  f"deleted {min(deleted):6.2f}-{max(deleted):6.2f} ms (6 runs)", flush=True)


def main():
    what = sys.argv[1] if len(sys.argv) > 1 else "hash"
    runs = {"hash": run_hash, "rbtree": run_rbtree, "pipapo": run_pipapo, "spread": run_spread,
            "affinity": run_affinity, "affinity-checked": lambda ns, svcs: run_affinity(ns, svcs, checked=True),
            "latency": run_latency, "grow": run_grow, "floor": run_floor}
    if what not in runs:
        sys.exit(f"usage: {sys.argv[0]} {'|'.join(runs)}")
    svcs = cluster()
    big = [s for s in svcs if s[1] > 16]
    print(f"{what}: kernel {os.uname().release}; "
          f"{subprocess.run(['nft', '--version'], capture_output=True, text=True).stdout.strip()}; "
          f"{SERVICES} Services, {sum(s[1] for s in svcs)} endpoints; {len(big)} Services with "
          f"17-5,000 endpoints ({sum(s[1] for s in big)} endpoints)", flush=True)
    with Netns() as ns:
        if what in ("hash", "rbtree", "pipapo"):
            ns.nft(base_table(), "table", quiet=True)
        runs[what](ns, svcs)


if __name__ == "__main__":
    main()
