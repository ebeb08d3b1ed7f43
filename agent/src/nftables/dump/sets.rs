//! Sets and their elements, decoded back into set declarations and keys.

use super::*;

// --- Sets and elements. ---

pub(super) struct RawSet {
    pub(super) name: String,
    flags: SetFlags,
    key_type: Option<u32>,
    key_len: Option<u32>,
    data_type: Option<u32>,
    data_len: Option<u32>,
    timeout_ms: Option<u64>,
    size: Option<u32>,
    comment: Result<Option<String>, ()>,
}

impl RawSet {
    pub(super) fn from_message(s: SetMessage) -> Option<RawSet> {
        let mut table = None;
        let mut raw = RawSet {
            name: String::new(),
            flags: SetFlags::empty(),
            key_type: None,
            key_len: None,
            data_type: None,
            data_len: None,
            timeout_ms: None,
            size: None,
            comment: Ok(None),
        };
        for a in s.attributes {
            match a {
                SetAttribute::Table(t) => table = Some(t),
                SetAttribute::Name(n) => raw.name = n,
                SetAttribute::Flags(f) => raw.flags = f,
                SetAttribute::KeyType(t) => raw.key_type = Some(t),
                SetAttribute::KeyLen(l) => raw.key_len = Some(l),
                SetAttribute::DataType(t) => raw.data_type = Some(t),
                SetAttribute::DataLen(l) => raw.data_len = Some(l),
                SetAttribute::Timeout(t) => raw.timeout_ms = Some(t),
                SetAttribute::Description(d) => {
                    for desc in d {
                        if let SetDescription::Size(n) = desc {
                            raw.size = Some(n).filter(|n| *n > 0);
                        }
                    }
                }
                SetAttribute::UserData(u) => raw.comment = udata_string(&u, UDATA_SET_COMMENT),
                _ => {}
            }
        }
        // Anonymous sets belong to the rule that uses them.
        if table.as_deref() != Some(TABLE)
            || raw.name.is_empty()
            || raw.flags.contains(SetFlags::Anonymous)
        {
            return None;
        }
        Some(raw)
    }

    /// The declaration, if nftproxy could have written it.
    pub(super) fn decl(&self, family: Family) -> Option<SetDecl> {
        if self.flags.contains(SetFlags::Interval) {
            return self.endpoint_decl(family);
        }
        let known = SetFlags::Map | SetFlags::Timeout | SetFlags::Eval;
        if !(self.flags - known).is_empty() {
            return None;
        }
        if self.flags == SetFlags::Map && self.data_type == Some(endpoint_data_layout(family).0) {
            return self.endpoint_decl(family);
        }
        if self.flags == known && self.data_type == Some(endpoint_data_layout(family).0) {
            return self.affinity_decl(family);
        }
        if self.flags == SetFlags::Map
            && let Some(decl) = self.value_map_decl(family)
        {
            return Some(decl);
        }
        let is_vmap = self.flags.contains(SetFlags::Map);
        if is_vmap != (self.data_type == Some(NFT_DATA_VERDICT)) {
            return None;
        }
        let dynamic = self.flags.contains(SetFlags::Timeout | SetFlags::Eval);
        if !dynamic && self.flags.intersects(SetFlags::Timeout | SetFlags::Eval) {
            return None;
        }
        let timeout_secs = if dynamic {
            let ms = self.timeout_ms?;
            if ms % 1000 != 0 {
                return None;
            }
            Some(u32::try_from(ms / 1000).ok()?)
        } else {
            None
        };
        let key = self.key_among(
            family,
            &[
                KeyType::Addr,
                KeyType::AddrProtoPort,
                KeyType::ProtoPort,
                KeyType::AddrPair,
                KeyType::AddrProto,
            ],
        )?;
        Some(SetDecl {
            key,
            is_vmap,
            comment: self.comment.clone().ok()?,
            timeout_secs,
            // The kernel gives dynamic sets a size of its own (65535), which nft hides too.
            size: self.size.filter(|_| !dynamic),
        })
    }

    /// The key type among `candidates` whose type id and length the set has.
    fn key_among(&self, family: Family, candidates: &[KeyType]) -> Option<KeyType> {
        candidates.iter().copied().find(|k| {
            let (t, l) = key_layout(family, *k);
            Some(l) == self.key_len && Some(t) == self.key_type
        })
    }

    /// The session-affinity map: client and destination to endpoint, filled by the kernel.
    fn affinity_decl(&self, family: Family) -> Option<SetDecl> {
        let data_len = endpoint_data_layout(family).1;
        let ms = self.timeout_ms?;
        let ok = self.data_len == Some(data_len)
            && ms % 1000 == 0
            && self
                .key_among(family, &[KeyType::AffinityClients])
                .is_some();
        ok.then_some(SetDecl {
            comment: self.comment.clone().ok()?,
            timeout_secs: Some(u32::try_from(ms / 1000).ok()?),
            size: self.size,
            ..SetDecl::new(KeyType::AffinityClients)
        })
    }

    /// A map from `[ADDR .] inet_proto . inet_service` or `ADDR . inet_proto . integer` to
    /// the family's addresses, or from `[ADDR .] inet_proto . inet_service` to ports.
    fn value_map_decl(&self, family: Family) -> Option<SetDecl> {
        let key = [
            KeyType::AddrProtoPortToAddr,
            KeyType::ProtoPortToAddr,
            KeyType::ProtoPortToPort,
            KeyType::AddrProtoIndex,
            KeyType::AddrProtoPortToPort,
        ]
        .into_iter()
        .find(|k| {
            value_data_layout(family, *k) == self.data_type.zip(self.data_len)
                && self.key_among(family, &[*k]).is_some()
        })?;
        Some(SetDecl {
            comment: self.comment.clone().ok()?,
            size: self.size,
            ..SetDecl::new(key)
        })
    }

    /// A map of endpoints (to the family's `ADDR . inet_service`): an endpoint-list map, a
    /// plain map from `[ADDR .] inet_proto . inet_service . integer`, or an endpoint map, an
    /// interval map (nothing else) from 4-byte values. An endpoint map's key type id is not
    /// checked: only nft reads it, and the elements mean the same whatever it is.
    fn endpoint_decl(&self, family: Family) -> Option<SetDecl> {
        let (data_type, data_len) = endpoint_data_layout(family);
        if (self.data_type, self.data_len) != (Some(data_type), Some(data_len)) {
            return None;
        }
        let key = if self.flags == SetFlags::Interval | SetFlags::Map {
            (self.key_len == Some(4)).then_some(KeyType::Interval)?
        } else if self.flags == SetFlags::Map {
            self.key_among(
                family,
                &[KeyType::AddrProtoPortIndex, KeyType::ProtoPortIndex],
            )?
        } else {
            return None;
        };
        Some(SetDecl {
            comment: self.comment.clone().ok()?,
            size: self.size,
            ..SetDecl::new(key)
        })
    }
}

pub(in crate::nftables) fn decode_addr(b: &[u8]) -> Option<IpAddr> {
    match b.len() {
        4 => Some(IpAddr::V4(Ipv4Addr::from(<[u8; 4]>::try_from(b).ok()?))),
        16 => Some(IpAddr::V6(Ipv6Addr::from(<[u8; 16]>::try_from(b).ok()?))),
        _ => None,
    }
}

pub(in crate::nftables) fn decode_proto_port(b: &[u8]) -> Option<(Proto, u16)> {
    if b.len() != 8 || b[1..4] != [0, 0, 0] || b[6..8] != [0, 0] {
        return None;
    }
    Some((Proto::from_number(b[0])?, u16::from_be_bytes([b[4], b[5]])))
}

/// A protocol padded to 4 bytes.
fn decode_proto(b: &[u8]) -> Option<Proto> {
    match b {
        [p, 0, 0, 0] => Proto::from_number(*p),
        _ => None,
    }
}

pub(super) fn decode_key(family: Family, key: KeyType, b: &[u8]) -> Option<Key> {
    let alen = addr_layout(family).2 as usize;
    match key {
        KeyType::Addr if b.len() == alen => Some(Key::Addr(decode_addr(b)?)),
        KeyType::AddrProtoPort | KeyType::AddrProtoPortToAddr | KeyType::AddrProtoPortToPort
            if b.len() == alen + 8 =>
        {
            let (p, port) = decode_proto_port(&b[alen..])?;
            Some(Key::AddrProtoPort(decode_addr(&b[..alen])?, p, port))
        }
        KeyType::ProtoPort | KeyType::ProtoPortToAddr | KeyType::ProtoPortToPort => {
            let (p, port) = decode_proto_port(b)?;
            Some(Key::ProtoPort(p, port))
        }
        KeyType::AddrProtoPortIndex if b.len() == alen + 12 => {
            let (p, port) = decode_proto_port(&b[alen..alen + 8])?;
            let i = u16::try_from(u32_ne(&b[alen + 8..])?).ok()?;
            Some(Key::AddrProtoPortIndex(
                decode_addr(&b[..alen])?,
                p,
                port,
                i,
            ))
        }
        KeyType::ProtoPortIndex if b.len() == 12 => {
            let (p, port) = decode_proto_port(&b[..8])?;
            let i = u16::try_from(u32_ne(&b[8..])?).ok()?;
            Some(Key::ProtoPortIndex(p, port, i))
        }
        KeyType::AddrProto if b.len() == alen + 4 => {
            let p = decode_proto(&b[alen..])?;
            Some(Key::AddrProto(decode_addr(&b[..alen])?, p))
        }
        KeyType::AddrProtoIndex if b.len() == alen + 8 => {
            let p = decode_proto(&b[alen..alen + 4])?;
            let i = u16::try_from(u32_ne(&b[alen + 4..])?).ok()?;
            Some(Key::AddrProtoIndex(decode_addr(&b[..alen])?, p, i))
        }
        // Only an address paired with itself is modelled; anything else is foreign.
        KeyType::AddrPair if b.len() == 2 * alen && b[..alen] == b[alen..] => {
            Some(Key::AddrPair(decode_addr(&b[..alen])?))
        }
        _ => None,
    }
}

pub(super) const NFTA_SET_ELEM_TIMEOUT: u16 = 4;
pub(super) const NFTA_SET_ELEM_EXPIRATION: u16 = 5;
pub(super) const NFTA_SET_ELEM_USERDATA: u16 = 6;

/// An interval bound of an endpoint map as the kernel lists it: `(value, Some(endpoint))` for a
/// start, `(value, None)` for an end.
pub(super) type IntervalBound = (u32, Option<(IpAddr, u16)>);

/// Adds the elements of the dump `msgs` to `out`; false if one cannot be decoded.
pub(super) fn decode_elements(
    family: Family,
    decl: &SetDecl,
    msgs: &[Vec<u8>],
    out: &mut Vec<(Key, Option<Value>)>,
) -> bool {
    if decl.key == KeyType::Interval {
        let mut bounds = Vec::new();
        if !walk_elements(msgs, |e| decode_interval_element(family, e, &mut bounds)) {
            return false;
        }
        // An interval is two elements, paired up once all are read.
        out.extend(
            region_elements_from_bounds(bounds)
                .into_iter()
                .map(|(k, v)| (k, Some(v))),
        );
        return true;
    }
    walk_elements(msgs, |e| decode_element(family, decl, e, out))
}

/// Calls `f` on every element of the dump `msgs`; false if one is malformed or `f` says so.
pub(in crate::nftables) fn walk_elements(
    msgs: &[Vec<u8>],
    mut f: impl FnMut(&[u8]) -> bool,
) -> bool {
    for m in msgs {
        let Some(attrs) = message_nlas(m) else {
            return false;
        };
        for (kind, list) in attrs {
            if kind != NFTA_SET_ELEM_LIST_ELEMENTS {
                continue;
            }
            let Some(elements) = nlas(list) else {
                return false;
            };
            for (kind, element) in elements {
                if kind != NFTA_LIST_ELEM || !f(element) {
                    return false;
                }
            }
        }
    }
    true
}

pub(super) fn decode_element(
    family: Family,
    decl: &SetDecl,
    element: &[u8],
    out: &mut Vec<(Key, Option<Value>)>,
) -> bool {
    let data = match decl.key {
        k if k.holds_endpoints() => Data::Endpoint,
        KeyType::AddrProtoPortToAddr | KeyType::ProtoPortToAddr | KeyType::AddrProtoIndex => {
            Data::Addr
        }
        KeyType::ProtoPortToPort | KeyType::AddrProtoPortToPort => Data::Port,
        _ => Data::Verdict,
    };
    let Some((key, value, false)) = raw_element(family, data, element) else {
        return false;
    };
    let Some(key) = decode_key(family, decl.key, &key) else {
        return false;
    };
    if (decl.is_vmap || decl.key.has_data()) != value.is_some() {
        return false;
    }
    out.push((key, value));
    true
}

/// What an element's data is, by its map's type.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Data {
    Verdict,
    Endpoint,
    Addr,
    Port,
}

/// One element as the kernel lists it: its key's bytes, its data (of kind `data`) and whether
/// it ends an interval; `None` if it is malformed or has anything else nftproxy does not write.
pub(super) fn raw_element(
    family: Family,
    data: Data,
    element: &[u8],
) -> Option<(Vec<u8>, Option<Value>, bool)> {
    let mut key = None;
    let mut value = None;
    let mut end = false;
    for (kind, v) in attr_map(element)? {
        match kind {
            NFTA_SET_ELEM_KEY => key = Some(data_value(v)?),
            NFTA_SET_ELEM_DATA => {
                value = Some(match data {
                    Data::Endpoint => {
                        let (addr, port) = decode_endpoint(family, &data_value(v)?)?;
                        Value::Endpoint(addr, port)
                    }
                    Data::Addr => {
                        let b = data_value(v)?;
                        if b.len() != addr_layout(family).2 as usize {
                            return None;
                        }
                        Value::Addr(decode_addr(&b)?)
                    }
                    Data::Port => {
                        let b = data_value(v)?;
                        Value::Port(u16::from_be_bytes(<[u8; 2]>::try_from(b.as_slice()).ok()?))
                    }
                    Data::Verdict => Value::Verdict(data_verdict(v)?),
                })
            }
            NFTA_SET_ELEM_FLAGS => match be_u32(v)? {
                0 => {}
                NFT_SET_ELEM_INTERVAL_END => end = true,
                _ => return None,
            },
            // Per-element timeouts, expirations, comments: nothing nftproxy compares.
            NFTA_SET_ELEM_TIMEOUT | NFTA_SET_ELEM_EXPIRATION | NFTA_SET_ELEM_USERDATA => {}
            _ => return None,
        }
    }
    Some((key?, value, end))
}

/// An element of the session-affinity map: its key's bytes and its endpoint.
pub(in crate::nftables) fn raw_affinity_element(
    family: Family,
    element: &[u8],
) -> Option<(Vec<u8>, (IpAddr, u16))> {
    match raw_element(family, Data::Endpoint, element)? {
        (key, Some(Value::Endpoint(addr, port)), false) => Some((key, (addr, port))),
        _ => None,
    }
}

/// An endpoint as map data: the address, then the port padded to 4 bytes.
pub(super) fn decode_endpoint(family: Family, b: &[u8]) -> Option<(IpAddr, u16)> {
    let alen = addr_layout(family).2 as usize;
    if b.len() != alen + 4 || b[alen + 2..] != [0, 0] {
        return None;
    }
    Some((
        decode_addr(&b[..alen])?,
        u16::from_be_bytes([b[alen], b[alen + 1]]),
    ))
}

/// One element of an endpoint map: a 4-byte big-endian key, and either the interval-end flag
/// or the endpoint as data (the address, the port padded to 4 bytes).
pub(super) fn decode_interval_element(
    family: Family,
    element: &[u8],
    out: &mut Vec<IntervalBound>,
) -> bool {
    let Some((key, value, end)) = raw_element(family, Data::Endpoint, element) else {
        return false;
    };
    let Some(at) = be_u32(&key) else {
        return false;
    };
    let target = match value {
        Some(Value::Endpoint(addr, port)) => Some((addr, port)),
        Some(Value::Verdict(_) | Value::Addr(_) | Value::Port(_)) => return false,
        None => None,
    };
    // A start carries its endpoint, an end nothing.
    if end == target.is_some() {
        return false;
    }
    out.push((at, target));
    true
}
