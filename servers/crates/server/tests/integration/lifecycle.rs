//! The process: ready line, SIGTERM, `--parent-pid`, and refusals at startup.

use std::process::{Command, Stdio};
use std::time::Duration;

use crate::harness::*;

#[test]
fn sigterm_exits_cleanly() {
    let mut server = TestServer::start(ServerOptions::default());
    assert!(server.addr.starts_with("127.0.0.1:"));
    let status = server.terminate();
    assert!(status.success(), "{status:?}");
}

#[test]
fn exits_when_the_parent_process_is_gone() {
    let mut parent = Command::new("sleep")
        .arg("60")
        .spawn()
        .expect("spawn sleep");
    let mut server = TestServer::start(ServerOptions {
        parent_pid: Some(parent.id()),
        ..Default::default()
    });
    std::thread::sleep(Duration::from_millis(700));
    assert!(
        server.child.try_wait().unwrap().is_none(),
        "parent alive, server running"
    );
    parent.kill().unwrap();
    parent.wait().unwrap();
    let status = server
        .wait_exit(Duration::from_secs(5))
        .expect("server exits after its parent");
    assert!(status.success(), "{status:?}");
}

fn run_with(args: &[&str]) -> (i32, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_pocketflow-server"))
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run server");
    assert!(out.stdout.is_empty() || !String::from_utf8_lossy(&out.stdout).contains("READY"));
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn startup_errors_are_reported_with_a_nonzero_exit() {
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let secret = dir.path().join("secret");
    std::fs::write(&secret, SECRET).unwrap();
    let short = dir.path().join("short");
    std::fs::write(&short, b"short").unwrap();
    let secret = secret.to_str().unwrap();

    let (code, err) = run_with(&[
        "--tier",
        "dram",
        "--capacity",
        "1MiB",
        "--secret-file",
        secret,
        "--listen",
        "0.0.0.0:0",
    ]);
    assert_eq!(code, 2);
    assert!(err.contains("not on every interface"), "{err}");
    // A node address needs TLS; the check comes before any bind (192.0.2.1 is TEST-NET-1).
    let (code, err) = run_with(&[
        "--tier",
        "dram",
        "--capacity",
        "1MiB",
        "--secret-file",
        secret,
        "--listen",
        "192.0.2.1:0",
    ]);
    assert_eq!(code, 2);
    assert!(err.contains("needs TLS"), "{err}");
    let (code, err) = run_with(&[
        "--tier",
        "dram",
        "--capacity",
        "lots",
        "--secret-file",
        secret,
    ]);
    assert_eq!(code, 2);
    assert!(err.contains("size"), "{err}");
    let (code, err) = run_with(&[
        "--tier",
        "dram",
        "--capacity",
        "1MiB",
        "--secret-file",
        "/nonexistent/secret",
    ]);
    assert_eq!(code, 1);
    assert!(err.contains("secret-file"), "{err}");
    let (code, err) = run_with(&[
        "--tier",
        "dram",
        "--capacity",
        "1MiB",
        "--secret-file",
        short.to_str().unwrap(),
    ]);
    assert_eq!(code, 1);
    assert!(err.contains("16"), "{err}");
    let (code, _) = run_with(&["--help"]);
    assert_eq!(code, 0);
}
