//! The process: ready line, SIGTERM, `--parent-pid`, and refusals at startup.

use std::process::{Command, Stdio};
use std::time::Duration;

use pocketflow_protocol::limits::ADMIN_JOB_ID;
use pocketflow_protocol::token::{now_unix_ms, TokenKey};
use serde_json::json;

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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_from_stdin_give_the_secret_and_no_key_path_is_on_the_command_line() {
    let server = TestServer::start(ServerOptions {
        keys_from_stdin: true,
        ..Default::default()
    });
    let cmdline = std::fs::read(format!("/proc/{}/cmdline", server.pid())).unwrap();
    let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
    assert!(!cmdline.contains("secret"), "{cmdline}");
    let client = server.client().await;
    // Tokens of the secret on stdin are taken, others refused.
    assert!(client.stats().await["node_id"] == "test-node");
    let forged = TokenKey::new(b"another-secret-of-the-same-size!!!")
        .unwrap()
        .make(ADMIN_JOB_ID, now_unix_ms() + 60_000);
    let refused = client
        .action(
            "stats",
            json!({"ctx": {"job": ADMIN_JOB_ID, "epoch": 0, "token": forged}}),
        )
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::PermissionDenied, "{refused}");
}

/// Run the server with `args` and `stdin` as its whole input; its exit code and stderr.
fn run_with_stdin(args: &[&str], stdin: &[u8]) -> (i32, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_pocketflow-server"))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run server");
    let mut pipe = child.stdin.take().unwrap();
    std::io::Write::write_all(&mut pipe, stdin).unwrap();
    drop(pipe);
    let out = child.wait_with_output().unwrap();
    assert!(!String::from_utf8_lossy(&out.stdout).contains("READY"));
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn a_bad_keys_document_stops_the_start_with_its_cause() {
    let base = ["--tier", "dram", "--capacity", "1MiB", "--keys-from-stdin"];
    let (code, err) = run_with_stdin(&base, b"");
    assert_eq!(code, 1);
    assert!(err.contains("ended before the keys document"), "{err}");
    let (code, err) = run_with_stdin(&base, b"{\"secret_hex\": \"00ff\"}");
    assert_eq!(code, 1);
    assert!(err.contains("16"), "{err}");
    // A node address needs the document to carry a TLS identity (TEST-NET-1, never bound).
    let secret = format!("{{\"secret_hex\": \"{}\"}}", hex_of(SECRET));
    let node = [&base[..], &["--listen", "192.0.2.1:0"]].concat();
    let (code, err) = run_with_stdin(&node, secret.as_bytes());
    assert_eq!(code, 1);
    assert!(err.contains("needs TLS"), "{err}");
}

#[test]
fn the_server_process_is_not_dumpable() {
    // Another process of the server's user must not read its memory or environment: those
    // /proc files belong to root when the process is not dumpable. The server runs as `nobody`
    // when the test is root, so that root ownership says something.
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    let server = TestServer::start(ServerOptions {
        keys_from_stdin: true,
        uid: root.then_some(NOBODY_UID),
        ..Default::default()
    });
    let status = std::fs::read_to_string(format!("/proc/{}/status", server.pid())).unwrap();
    let uid: u32 = status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|l| l.split_whitespace().next())
        .and_then(|uid| uid.parse().ok())
        .expect("Uid line");
    assert_ne!(uid, 0, "the server must run as another user than root here");
    for file in ["environ", "mem", "maps"] {
        let meta = std::fs::metadata(format!("/proc/{}/{file}", server.pid())).unwrap();
        assert_eq!(
            std::os::unix::fs::MetadataExt::uid(&meta),
            0,
            "/proc/<pid>/{file} belongs to the server's user {uid}: it is dumpable"
        );
    }
}

/// The `nobody` user.
const NOBODY_UID: u32 = 65_534;
