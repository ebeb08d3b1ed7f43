//! The agent's logs as operators configure them: JSON lines with `--log-format json` or the
//! config's `logging.format`, text by default. Needs no root (`render` touches no kernel).

use std::path::Path;
use std::process::Command;

use nftproxy_tests::target_binary;
use serde_json::Value;

fn render(args: &[&str]) -> std::process::Output {
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/malformed.yaml");
    Command::new(target_binary("nftproxy").expect("build nftproxy first"))
        .arg("render")
        .arg("--from-file")
        .arg(fixture)
        .args(args)
        .env_remove("RUST_LOG")
        .output()
        .unwrap()
}

/// The skipped-object warnings of a render, parsed as JSON.
fn json_warnings(out: &std::process::Output) -> Vec<Value> {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let lines: Vec<Value> = stderr
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    assert!(!lines.is_empty(), "no log lines");
    lines.into_iter().filter(|l| l["level"] == "WARN").collect()
}

#[test]
fn log_format_json_writes_one_object_per_line() {
    let warnings = json_warnings(&render(&["--log-format", "json"]));
    assert!(
        warnings
            .iter()
            .any(|w| w["name"] == "ns1/bad-ip" && w["timestamp"].is_string()),
        "{warnings:#?}"
    );
}

#[test]
fn the_configs_logging_format_is_honoured() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("config.yaml");
    std::fs::write(
        &config,
        "kind: KubeProxyConfiguration\nlogging: {format: json}\n",
    )
    .unwrap();
    let warnings = json_warnings(&render(&["--config", config.to_str().unwrap()]));
    assert!(
        warnings.iter().any(|w| w["name"] == "ns1/port-zero"),
        "{warnings:#?}"
    );
    // The flag wins over the file.
    let out = render(&["--config", config.to_str().unwrap(), "--log-format", "text"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("WARN") && !stderr.trim_start().starts_with('{'),
        "{stderr}"
    );
}

#[test]
fn an_unknown_log_format_is_a_configuration_error() {
    let out = render(&["--log-format", "xml"]);
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("xml"), "{stderr}");
}
