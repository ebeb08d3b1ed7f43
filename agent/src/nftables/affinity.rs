//! The session-affinity map's entries (see `dataplane::nft::build::affinity`): listed, and the
//! stale ones deleted after a sync.

use std::collections::HashSet;
use std::io;

use dataplane::nft::build::affinity::{AFFINITY_CLIENTS, Entry};
use dataplane::nft::ruleset::{Family, TABLE};
use netlink_packet_netfilter::nftables::{NfTablesMessage, SetElementList, SetElementMessage};

use super::dump::{decode_addr, decode_proto_port, raw_affinity_element, walk_elements};
use super::encode::{self, addr_layout, affinity_key_bytes};
use super::{NftError, Nftables, Reply};

/// Deletions tried before giving up until the next sync: an entry that expires between the
/// listing and the deletion fails the whole batch (ENOENT), and is gone from the next listing.
const DELETE_ATTEMPTS: usize = 3;

impl Nftables {
    /// The entries of `affinity-clients` in `family`'s table (none without the table or map).
    pub fn affinity_entries(&mut self, family: Family) -> Result<Vec<Entry>, NftError> {
        let msg = NfTablesMessage::GetSetElement(SetElementMessage {
            attributes: vec![
                SetElementList::Table(TABLE.to_string()),
                SetElementList::Set(AFFINITY_CLIENTS.to_string()),
            ],
        });
        // An interrupted dump may miss entries made meanwhile: they are new, so not stale.
        let messages = match self.request("affinity dump", family, msg, true)? {
            Reply::Errno(libc::ENOENT) => return Ok(Vec::new()),
            Reply::Errno(errno) => {
                return Err(NftError::Request {
                    request: "affinity dump",
                    errno,
                    source: io::Error::from_raw_os_error(errno),
                });
            }
            Reply::Messages { messages, .. } => messages,
        };
        let mut entries = Vec::new();
        let ok = walk_elements(&messages, |element| {
            match decode_entry(family, element) {
                Some(e) => entries.push(e),
                // Not one we could have written: left alone.
                None => tracing::debug!("undecodable session-affinity entry"),
            }
            true
        });
        if !ok {
            return Err(NftError::Decode {
                request: "affinity dump",
                reason: "malformed element message".to_string(),
            });
        }
        Ok(entries)
    }

    /// Deletes `stale` entries of `affinity-clients` (just listed by the caller); returns how
    /// many. An entry that expired meanwhile fails the whole batch: then the map is listed again
    /// and the rest of `stale` deleted.
    pub fn delete_affinity_entries(
        &mut self,
        family: Family,
        stale: &[Entry],
    ) -> Result<usize, NftError> {
        let mut wanted: Vec<Entry> = stale.to_vec();
        let mut attempt = 1;
        while !wanted.is_empty() {
            let keys: Vec<Vec<u8>> = wanted.iter().map(affinity_key_bytes).collect();
            let batch = encode::encode_delete_elements(family, AFFINITY_CLIENTS, &keys, self.seq);
            self.seq = batch.end_seq().wrapping_add(1);
            self.send_raw_batch(&batch)?;
            let Some(&(_, errno)) = self.batch_replies(&batch)?.first() else {
                return Ok(wanted.len());
            };
            if errno != libc::ENOENT || attempt == DELETE_ATTEMPTS {
                return Err(NftError::Batch {
                    errno,
                    source: io::Error::from_raw_os_error(errno),
                });
            }
            attempt += 1;
            let present: HashSet<Entry> = self.affinity_entries(family)?.into_iter().collect();
            wanted.retain(|e| present.contains(e));
        }
        Ok(0)
    }
}

/// One listed element of `affinity-clients`.
fn decode_entry(family: Family, element: &[u8]) -> Option<Entry> {
    let (key, endpoint) = raw_affinity_element(family, element)?;
    let alen = addr_layout(family).2 as usize;
    if key.len() != 2 * alen + 8 {
        return None;
    }
    let (proto, port) = decode_proto_port(&key[2 * alen..])?;
    Some(Entry {
        client: decode_addr(&key[..alen])?,
        dest: decode_addr(&key[alen..2 * alen])?,
        proto,
        port,
        endpoint,
    })
}
