//! The file source: Kubernetes objects as `kubectl get ... -o yaml` or `-o json` prints them
//! (a `kind: List`), as a stream of YAML documents or as a stream of JSON objects.
//!
//! Every reader of a file (`render`, `trace`, `run --once`, the followed file of `run
//! --from-file`) goes through [`relist`]: each object is applied to a tracker as soon as it is
//! parsed, so that the file's objects never all exist at once, and every reader treats an
//! object listed twice the same way: the last copy wins, as a later update would (an invalid
//! last copy removes the object and is reported).

use std::path::Path;

use dataplane::convert::Skipped;
use std::io::Read as _;

use dataplane::input::{Cutter, Object};
use dataplane::model::Cluster;
use dataplane::tracker::{Kind, Tracker};

/// Reads and converts a file. An unreadable or unparseable file is an error (naming the
/// file and line); invalid objects inside it are returned as skipped and otherwise ignored.
pub fn load_file(
    path: &Path,
    node_name: &str,
    proxy_name: &str,
) -> Result<(Cluster, Vec<Skipped>), String> {
    let mut tracker = Tracker::new(node_name, proxy_name);
    let skipped = relist(&mut tracker, Input::File(path, BLOCK))?;
    Ok((tracker.cluster().clone(), skipped))
}

/// Converts text already in memory (see [`load_file`]).
pub fn load_text(
    text: &str,
    node_name: &str,
    proxy_name: &str,
) -> Result<(Cluster, Vec<Skipped>), String> {
    let mut tracker = Tracker::new(node_name, proxy_name);
    let skipped = relist(&mut tracker, Input::Text(text))?;
    Ok((tracker.cluster().clone(), skipped))
}

/// Bytes read from a file at a time.
const BLOCK: usize = 4 << 20;

/// Reads a file a block at a time and hands it to `piece` in pieces that read as they would
/// whole ([`Cutter`]), each with the number of lines before it: the text held is a piece and
/// a block, not the file (a `kind: List` is one piece, though).
fn for_each_piece(
    path: &Path,
    block: usize,
    mut piece: impl FnMut(&str, usize) -> Result<(), String>,
) -> Result<(), String> {
    let failed = |e: &dyn std::fmt::Display| format!("{}: {e}", path.display());
    let mut file = std::fs::File::open(path).map_err(|e| failed(&e))?;
    let mut buf: Vec<u8> = Vec::new();
    let mut cutter: Option<Cutter> = None;
    let mut lines = 0;
    loop {
        // Into the buffer's spare room, not zeroed first (a `kind: List` is read whole).
        let n = (&mut file)
            .take(block.max(1) as u64)
            .read_to_end(&mut buf)
            .map_err(|e| failed(&e))?;
        let utf8 = |bytes| {
            std::str::from_utf8(bytes)
                .map_err(|_| failed(&format_args!("invalid UTF-8 after line {lines}")))
        };
        if n == 0 {
            return match buf.is_empty() {
                true => Ok(()),
                false => piece(utf8(&buf)?, lines),
            };
        }
        let cutter = cutter.get_or_insert_with(|| Cutter::new(&buf));
        if let Some(cut) = cutter.last_cut(&buf) {
            let part = utf8(&buf[..cut])?;
            piece(part, lines)?;
            lines += part.bytes().filter(|b| *b == b'\n').count();
            buf.drain(..cut);
            cutter.cut(cut);
        }
    }
}

/// Logs each skipped object once, with its kind, name and reason.
pub fn report_skipped(skipped: &[Skipped]) {
    for s in skipped {
        tracing::warn!(kind = %s.kind, name = %s.name, reason = %s.skip, "skipping invalid object");
    }
}

/// Where [`relist`] reads objects from.
#[derive(Clone, Copy)]
enum Input<'a> {
    Text(&'a str),
    /// Read in pieces, a block of this many bytes at a time (see [`for_each_piece`]).
    File(&'a Path, usize),
}

/// Replaces the tracker's content with the objects of `input`, as a re-list of every kind
/// would: objects missing from it are deleted, unchanged ones cause no sync. Returns the
/// objects skipped as invalid. On an error (a syntax error, an unreadable file) the tracker
/// is half-way through: callers stage a copy.
fn relist(tracker: &mut Tracker, input: Input<'_>) -> Result<Vec<Skipped>, String> {
    for kind in Kind::ALL {
        tracker.begin_list(kind);
    }
    let mut skipped = Vec::new();
    let mut invalid = Vec::new();
    // The tracker warns about an object the file names twice (see `Tracker::end_list`).
    let mut read = |text: &str| {
        dataplane::input::for_each_object(text, &mut skipped, |object| {
            invalid.extend(match &object {
                Object::Service(o) => tracker.apply_service(o),
                Object::Slice(o) => tracker.apply_slice(o),
                Object::Node(o) => tracker.apply_node(o),
                Object::ServiceCidr(o) => tracker.apply_service_cidr(o),
            })
        })
    };
    match input {
        Input::Text(text) => read(text).map_err(|e| e.to_string())?,
        Input::File(path, block) => for_each_piece(path, block, |text, lines| {
            read(text).map_err(|e| format!("{}: {}", path.display(), e.after_lines(lines)))
        })?,
    }
    for kind in Kind::ALL {
        tracker.end_list(kind);
    }
    skipped.extend(invalid);
    Ok(skipped)
}

/// Replaces the tracker's content with the objects of a file (see [`relist`]). A file that
/// cannot be parsed changes nothing. The memory the load freed stays with the allocator:
/// agents that keep running hand it back with [`crate::memory::release_freed`].
pub fn load_into(tracker: &mut Tracker, path: &Path) -> Result<(), String> {
    let mut staged = tracker.clone();
    let skipped = relist(&mut staged, Input::File(path, BLOCK))?;
    *tracker = staged;
    report_skipped(&skipped);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use dataplane::model::ObjectName;

    fn service(name: &str, ip: &str) -> String {
        format!(
            "apiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: ns}}\n\
             spec: {{clusterIP: {ip}, ports: [{{port: 80, protocol: TCP}}]}}\n"
        )
    }

    fn write(name: &str, text: &str) -> std::path::PathBuf {
        let path =
            std::env::temp_dir().join(format!("nftproxy-source-{}-{name}", std::process::id()));
        std::fs::write(&path, text).unwrap();
        path
    }

    /// A file read a few bytes at a time, cut into many pieces, gives what its text gives
    /// whole, in every format; a syntax error names the file's line, not the piece's.
    #[test]
    fn a_file_read_in_pieces_reads_as_a_whole() {
        let docs: Vec<String> = (0..40)
            .map(|i| service(&format!("s{i}"), &format!("10.96.0.{}", i + 1)))
            .collect();
        let json: Vec<String> = (0..40)
            .map(|i| {
                format!(
                    "{{\"apiVersion\": \"v1\", \"kind\": \"Service\", \"metadata\": \
                     {{\"name\": \"j{i}\", \"namespace\": \"ns\"}}, \"spec\": \
                     {{\"clusterIP\": \"10.97.0.{}\", \"ports\": [{{\"port\": 80}}]}}}}\n",
                    i + 1
                )
            })
            .collect();
        let texts = [
            docs.iter().map(|d| format!("---\n{d}")).collect::<String>(),
            docs.join("---\n"),
            json.concat(),
        ];
        for (n, text) in texts.iter().enumerate() {
            let path = write(&format!("pieces-{n}"), text);
            let (whole, _) = load_text(text, "node", "").unwrap();
            assert_eq!(whole.services.len(), 40);
            for block in [1, 7, 64, 1000, 1 << 20] {
                let mut tracker = Tracker::new("node", "");
                relist(&mut tracker, Input::File(&path, block)).unwrap();
                assert_eq!(tracker.cluster(), &whole, "text {n}, block {block}");
            }
            std::fs::remove_file(&path).unwrap();
        }
        let broken = format!("{}---\nkind: [\n", texts[0]);
        let line = broken.lines().count();
        let path = write("pieces-broken", &broken);
        let whole = load_text(&broken, "node", "").unwrap_err();
        for block in [7, 1 << 20] {
            let mut tracker = Tracker::new("node", "");
            let err = relist(&mut tracker, Input::File(&path, block)).unwrap_err();
            assert!(err.contains(&format!("line {}", line + 1)), "{err}");
            assert_eq!(err, format!("{}: {whole}", path.display()));
        }
        std::fs::remove_file(&path).unwrap();
    }

    /// `render`/`trace`/`--once` and the followed file agree on a Service listed twice: the
    /// last copy wins, and an invalid last copy removes it (reported).
    #[test]
    fn the_last_copy_of_an_object_wins_everywhere() {
        let invalid = "apiVersion: v1\nkind: Service\nmetadata: {name: a, namespace: ns}\n\
                       spec: {clusterIP: 10.96.0.1, ports: [{port: 0}]}\n";
        for (text, kept) in [
            (
                format!(
                    "{}---\n{}",
                    service("a", "10.96.0.1"),
                    service("a", "10.96.0.2")
                ),
                true,
            ),
            (
                format!("{}---\n{invalid}", service("a", "10.96.0.1")),
                false,
            ),
            (format!("{invalid}---\n{}", service("a", "10.96.0.1")), true),
        ] {
            let (cluster, skipped) = load_text(&text, "node", "").unwrap();
            let path = write("dup.yaml", &text);
            let mut tracker = Tracker::new("node", "");
            load_into(&mut tracker, &path).unwrap();
            let _ = std::fs::remove_file(path);
            let a = ObjectName::new("ns", "a");
            for c in [&cluster, tracker.cluster()] {
                assert_eq!(c.services.contains_key(&a), kept, "{text}");
                if kept {
                    assert_eq!(
                        c.services[&a].cluster_ips[0].to_string(),
                        if text.ends_with("10.96.0.2, ports: [{port: 80, protocol: TCP}]}\n") {
                            "10.96.0.2"
                        } else {
                            "10.96.0.1"
                        }
                    );
                }
            }
            // Every invalid copy is reported, even one a later valid copy replaced.
            assert_eq!(skipped.is_empty(), !text.contains("port: 0"), "{skipped:?}");
        }
    }

    #[test]
    fn a_file_broken_half_way_changes_nothing() {
        let mut tracker = Tracker::new("node", "");
        let good = write("good.yaml", &service("a", "10.96.0.1"));
        load_into(&mut tracker, &good).unwrap();
        let names = |t: &Tracker| t.cluster().services.keys().cloned().collect::<Vec<_>>();
        assert_eq!(names(&tracker), [ObjectName::new("ns", "a")]);

        // b parses, then the YAML breaks: neither b's arrival nor a's removal may take effect.
        let broken = write(
            "broken.yaml",
            &format!(
                "{}---\nkind: Service\nmetadata: [unterminated\n",
                service("b", "10.96.0.2")
            ),
        );
        let err = load_into(&mut tracker, &broken).unwrap_err();
        assert!(err.contains("broken.yaml") && err.contains("line"), "{err}");
        assert_eq!(names(&tracker), [ObjectName::new("ns", "a")]);

        let next = write("next.yaml", &service("b", "10.96.0.2"));
        load_into(&mut tracker, &next).unwrap();
        assert_eq!(names(&tracker), [ObjectName::new("ns", "b")]);
        for p in [good, broken, next] {
            let _ = std::fs::remove_file(p);
        }
    }
}
