//! Command-line flags of `pocketflow-server`, parsed once at the edge into typed values.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use pocketflow_store::Tier;

/// Usage text printed by `--help` and after a flag error.
pub const USAGE: &str = "usage: pocketflow-server --tier dram|nvme --capacity SIZE --secret-file PATH \
[--listen 127.0.0.1:PORT] [--nvme-path FILE] [--long-running] [--node-id NAME] [--parent-pid PID] [--threads N] \
[--persist-ttl DURATION] [--transfer-idle DURATION]
  SIZE is bytes, or a number with KiB, MiB, GiB or TiB (e.g. 256MiB, 2GiB)
  DURATION is seconds, or a number with ms, s, m or h (e.g. 500ms, 30s, 24h); PERSIST objects
  never expire without --persist-ttl; a DoPut or DoGet that moves nothing for --transfer-idle
  (default 30s) is ended and gives back its transfer slot";

/// Everything the flags say.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Args {
    /// Tier served.
    pub tier: Tier,
    /// Capacity of the tier in bytes.
    pub capacity_bytes: u64,
    /// File holding the cluster secret (its exact bytes).
    pub secret_file: PathBuf,
    /// Loopback address to listen on.
    pub listen: SocketAddr,
    /// File or block device of the NVMe tier.
    pub nvme_path: Option<PathBuf>,
    /// Whether PERSIST objects are accepted.
    pub long_running: bool,
    /// Name of the server in statistics.
    pub node_id: String,
    /// Exit when this process is gone.
    pub parent_pid: Option<i32>,
    /// Runtime worker threads.
    pub threads: usize,
    /// How long PERSIST objects live after they are written (`None`: until the server exits).
    pub persist_ttl: Option<Duration>,
    /// How long a DoPut or DoGet may move nothing before it is ended.
    pub transfer_idle: Duration,
}

/// What the command line asks for.
#[derive(Debug, PartialEq, Eq)]
pub enum Command {
    /// Run the server.
    Run(Args),
    /// Print usage and exit 0.
    Help,
}

/// A flag error, with a message for the user.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ArgsError(pub String);

fn err<T>(message: impl Into<String>) -> Result<T, ArgsError> {
    Err(ArgsError(message.into()))
}

/// Parse a size: plain bytes or a number with a binary unit (`KiB`, `MiB`, `GiB`, `TiB`; `B` too).
pub fn parse_size_bytes(text: &str) -> Result<u64, ArgsError> {
    let text = text.trim();
    let digits_end = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(digits_end);
    if number.is_empty() {
        return err(format!(
            "size {text:?} must start with a number of bytes, e.g. 268435456 or 256MiB"
        ));
    }
    let multiplier: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "kib" => 1 << 10,
        "mib" => 1 << 20,
        "gib" => 1 << 30,
        "tib" => 1 << 40,
        other => {
            return err(format!(
                "size {text:?} has unknown unit {other:?}; use B, KiB, MiB, GiB or TiB"
            ))
        }
    };
    let number: u64 = number
        .parse()
        .map_err(|_| ArgsError(format!("size {text:?} is too large")))?;
    let bytes = number
        .checked_mul(multiplier)
        .ok_or_else(|| ArgsError(format!("size {text:?} is too large")))?;
    if bytes == 0 {
        return err("size must be greater than zero");
    }
    Ok(bytes)
}

/// `--transfer-idle` when not given.
pub const TRANSFER_IDLE_DEFAULT: Duration = Duration::from_secs(30);
/// Shortest `--transfer-idle`.
pub const TRANSFER_IDLE_MIN: Duration = Duration::from_millis(100);
/// Longest `--transfer-idle`.
pub const TRANSFER_IDLE_MAX: Duration = Duration::from_secs(3600);

/// Longest `--persist-ttl`: 365 days.
pub const PERSIST_TTL_MAX: Duration = Duration::from_secs(365 * 24 * 3600);

/// Parse a duration: seconds, or a number with `ms`, `s`, `m` or `h`; 1 ms..=365 days.
pub fn parse_duration(text: &str) -> Result<Duration, ArgsError> {
    let text = text.trim();
    let digits_end = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(digits_end);
    let number: u64 = number.parse().map_err(|_| {
        ArgsError(format!(
            "duration {text:?} must be a whole number with ms, s, m or h, e.g. 30s"
        ))
    })?;
    let millis_per_unit: u64 = match unit.trim() {
        "ms" => 1,
        "" | "s" => 1000,
        "m" => 60_000,
        "h" => 3_600_000,
        other => {
            return err(format!(
                "duration {text:?} has unknown unit {other:?}; use ms, s, m or h"
            ))
        }
    };
    let millis = number
        .checked_mul(millis_per_unit)
        .ok_or_else(|| ArgsError(format!("duration {text:?} is too long")))?;
    let duration = Duration::from_millis(millis);
    if duration.is_zero() || duration > PERSIST_TTL_MAX {
        return err(format!("duration {text:?} must be in 1ms..=365 days"));
    }
    Ok(duration)
}

/// Parse a listen address; only loopback addresses are accepted (`localhost` means 127.0.0.1).
pub fn parse_listen(text: &str) -> Result<SocketAddr, ArgsError> {
    let addr = match text.strip_prefix("localhost:") {
        Some(port) => {
            let port = port
                .parse()
                .map_err(|_| ArgsError(format!("--listen {text:?}: bad port")))?;
            SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), port)
        }
        None => text
            .parse()
            .map_err(|_| ArgsError(format!("--listen {text:?} is not HOST:PORT")))?,
    };
    if !addr.ip().is_loopback() {
        return err(format!(
            "--listen {text:?} refused: the server binds to loopback addresses only"
        ));
    }
    Ok(addr)
}

fn default_threads() -> usize {
    std::thread::available_parallelism()
        .map(usize::from)
        .unwrap_or(1)
}

/// Parse the arguments after the program name.
pub fn parse(argv: impl IntoIterator<Item = String>) -> Result<Command, ArgsError> {
    let mut tier = None;
    let mut capacity_bytes = None;
    let mut secret_file = None;
    let mut listen = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0);
    let mut nvme_path = None;
    let mut long_running = false;
    let mut node_id = None;
    let mut parent_pid = None;
    let mut threads = None;
    let mut persist_ttl = None;
    let mut transfer_idle = TRANSFER_IDLE_DEFAULT;
    let mut argv = argv.into_iter();
    while let Some(flag) = argv.next() {
        // Accept both `--flag value` and `--flag=value`.
        let (name, inline) = match flag.split_once('=') {
            Some((name, value)) if name.starts_with("--") => {
                (name.to_owned(), Some(value.to_owned()))
            }
            _ => (flag.clone(), None),
        };
        let mut value = |name: &str| -> Result<String, ArgsError> {
            match inline.clone().or_else(|| argv.next()) {
                Some(v) => Ok(v),
                None => err(format!("{name} needs a value")),
            }
        };
        match name.as_str() {
            "--help" | "-h" => return Ok(Command::Help),
            "--tier" => {
                tier = Some(match value("--tier")?.as_str() {
                    "dram" => Tier::Dram,
                    "nvme" => Tier::Nvme,
                    other => return err(format!("--tier {other:?}: expected dram or nvme")),
                })
            }
            "--capacity" => capacity_bytes = Some(parse_size_bytes(&value("--capacity")?)?),
            "--secret-file" => secret_file = Some(PathBuf::from(value("--secret-file")?)),
            "--listen" => listen = parse_listen(&value("--listen")?)?,
            "--nvme-path" => nvme_path = Some(PathBuf::from(value("--nvme-path")?)),
            "--long-running" => {
                if inline.is_some() {
                    return err("--long-running takes no value");
                }
                long_running = true
            }
            "--node-id" => {
                let id = value("--node-id")?;
                if id.is_empty() || id.len() > 128 {
                    return err("--node-id must be 1..=128 bytes");
                }
                node_id = Some(id)
            }
            "--parent-pid" => {
                let text = value("--parent-pid")?;
                let pid: i32 = text
                    .parse()
                    .map_err(|_| ArgsError(format!("--parent-pid {text:?} is not a pid")))?;
                if pid <= 0 {
                    return err(format!("--parent-pid {pid} is not a pid"));
                }
                parent_pid = Some(pid)
            }
            "--threads" => {
                let text = value("--threads")?;
                let n: usize = text
                    .parse()
                    .map_err(|_| ArgsError(format!("--threads {text:?} is not a number")))?;
                if n == 0 || n > 1024 {
                    return err("--threads must be in 1..=1024");
                }
                threads = Some(n)
            }
            "--persist-ttl" => persist_ttl = Some(parse_duration(&value("--persist-ttl")?)?),
            "--transfer-idle" => {
                transfer_idle = parse_duration(&value("--transfer-idle")?)?;
                if transfer_idle < TRANSFER_IDLE_MIN || transfer_idle > TRANSFER_IDLE_MAX {
                    return err("--transfer-idle must be in 100ms..=1h");
                }
            }
            other => return err(format!("unknown flag {other:?}")),
        }
    }
    let tier = tier.ok_or_else(|| ArgsError("--tier is required".into()))?;
    if tier == Tier::Nvme && nvme_path.is_none() {
        return err("--tier nvme needs --nvme-path");
    }
    Ok(Command::Run(Args {
        tier,
        capacity_bytes: capacity_bytes.ok_or_else(|| ArgsError("--capacity is required".into()))?,
        secret_file: secret_file.ok_or_else(|| ArgsError("--secret-file is required".into()))?,
        listen,
        nvme_path,
        long_running,
        node_id: node_id.unwrap_or_else(|| format!("{}-{}", tier.as_str(), std::process::id())),
        parent_pid,
        threads: threads.unwrap_or_else(default_threads),
        persist_ttl,
        transfer_idle,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn argv(text: &str) -> Vec<String> {
        text.split_whitespace().map(str::to_owned).collect()
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size_bytes("268435456"), Ok(268_435_456));
        assert_eq!(parse_size_bytes("256MiB"), Ok(256 << 20));
        assert_eq!(parse_size_bytes("2GiB"), Ok(2 << 30));
        assert_eq!(parse_size_bytes("64 KiB"), Ok(64 << 10));
        assert_eq!(parse_size_bytes("1tib"), Ok(1 << 40));
        assert_eq!(parse_size_bytes("10B"), Ok(10));
        for bad in [
            "",
            "MiB",
            "0",
            "12XB",
            "-5",
            "1.5GiB",
            "99999999999999999999",
            "20000000TiB",
        ] {
            assert!(parse_size_bytes(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn listen_addresses() {
        assert_eq!(parse_listen("127.0.0.1:0").unwrap().port(), 0);
        assert!(parse_listen("[::1]:9000").is_ok());
        assert!(parse_listen("localhost:7").is_ok());
        assert!(parse_listen("0.0.0.0:9000").is_err());
        assert!(parse_listen("10.0.0.1:9000").is_err());
        assert!(parse_listen("nonsense").is_err());
    }

    #[test]
    fn full_command_line() {
        let cmd = parse(argv(
            "--listen 127.0.0.1:0 --node-id n1 --tier nvme --capacity 268435456 --secret-file /s \
             --long-running --nvme-path /tmp/x --threads 2 --parent-pid 42 --persist-ttl 90s \
             --transfer-idle 5s",
        ))
        .unwrap();
        let Command::Run(args) = cmd else {
            panic!("expected run")
        };
        assert_eq!(args.tier, Tier::Nvme);
        assert_eq!(args.capacity_bytes, 256 << 20);
        assert_eq!(args.node_id, "n1");
        assert!(args.long_running);
        assert_eq!(args.parent_pid, Some(42));
        assert_eq!(args.threads, 2);
        assert_eq!(args.persist_ttl, Some(Duration::from_secs(90)));
        assert_eq!(args.transfer_idle, Duration::from_secs(5));
        assert_eq!(args.nvme_path, Some(PathBuf::from("/tmp/x")));
        let Command::Run(args) =
            parse(argv("--tier=dram --capacity=1MiB --secret-file=/s")).unwrap()
        else {
            panic!("expected run")
        };
        assert_eq!(args.capacity_bytes, 1 << 20);
        assert_eq!(args.persist_ttl, None);
        assert_eq!(args.transfer_idle, TRANSFER_IDLE_DEFAULT);
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("30"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("24h"), Ok(Duration::from_secs(24 * 3600)));
        for bad in [
            "",
            "0",
            "0s",
            "1.5s",
            "3d",
            "-1s",
            "9000h",
            "99999999999999999999h",
        ] {
            assert!(parse_duration(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn flag_errors() {
        assert_eq!(parse(argv("--help")), Ok(Command::Help));
        for bad in [
            "--capacity 1MiB --secret-file /s",
            "--tier dram --secret-file /s",
            "--tier dram --capacity 1MiB",
            "--tier tape --capacity 1MiB --secret-file /s",
            "--tier nvme --capacity 1MiB --secret-file /s",
            "--tier dram --capacity 1MiB --secret-file /s --listen 0.0.0.0:1",
            "--tier dram --capacity 1MiB --secret-file /s --threads 0",
            "--tier dram --capacity 1MiB --secret-file /s --parent-pid x",
            "--tier dram --capacity 1MiB --secret-file /s --bogus",
            "--tier dram --capacity 1MiB --secret-file /s --persist-ttl 0s",
            "--tier dram --capacity 1MiB --secret-file /s --transfer-idle 50ms",
            "--tier dram --capacity 1MiB --secret-file /s --transfer-idle 2h",
            "--tier dram --capacity",
        ] {
            assert!(parse(argv(bad)).is_err(), "{bad}");
        }
    }
}
