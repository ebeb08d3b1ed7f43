//! `nftproxy demo`: runs to completion with traffic for every example Service, agrees with
//! `nftproxy trace`, and leaves nothing behind, also when interrupted half-way.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use nftproxy_tests::{list_namespaces, target_binary};

fn leftovers(pid: u32) -> Vec<String> {
    let prefix = format!("nftpdemo-{pid}-");
    let mut left: Vec<String> = list_namespaces()
        .unwrap()
        .into_iter()
        .filter(|n| n.starts_with(&prefix))
        .collect();
    // Echo servers of that demo run: `nftproxy demo-echo --name web-N ...`.
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        if cmdline.contains("demo-echo") && cmdline.contains(&prefix) {
            left.push(cmdline);
        }
    }
    left
}

#[test]
fn demo_runs_agrees_with_trace_and_cleans_up() {
    nftproxy_tests::require_root!();
    let bin = target_binary("nftproxy").expect("build nftproxy first");
    let out = Command::new(&bin).arg("demo").output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "demo failed: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for service in [
        "demo/web ",
        "demo/web-nodeport",
        "demo/web-lb",
        "demo/dns",
        "demo/empty",
    ] {
        assert!(
            stdout.contains(service),
            "no table for {service}:\n{stdout}"
        );
    }
    assert!(stdout.contains("web-3"), "{stdout}");
    assert!(stdout.contains("refused (REJECT)"), "{stdout}");
    assert!(stdout.contains("8 of 8 flows behaved exactly"), "{stdout}");
    assert!(!stdout.contains("DIFFERS"), "{stdout}");

    // Interrupted half-way: still nothing left behind.
    let mut child = Command::new(&bin)
        .arg("demo")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    // Interrupt while the lab is being built: as soon as the second pod exists.
    let half_way = format!("nftpdemo-{pid}-web-2");
    let start = Instant::now();
    while !list_namespaces().unwrap().contains(&half_way) {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "demo never got half-way"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    // SAFETY: kill with a PID we own and a valid signal.
    unsafe { libc::kill(pid as libc::pid_t, libc::SIGINT) };
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "demo ignored SIGINT"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(!status.success(), "an interrupted demo reports it");
    let left = leftovers(pid);
    assert!(left.is_empty(), "left behind: {left:?}");
}
