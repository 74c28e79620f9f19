//! The command line: `serve ...` or `client ...`, each with `--flag value` pairs.

use std::net::SocketAddr;

use crate::error::Error;
use crate::server::ServeOptions;

/// Default lifetime of a server: it exits by itself after this long.
const LIFETIME_S_DEFAULT: f64 = 3600.0;

/// What to run.
#[derive(Debug, PartialEq)]
pub enum Command {
    /// The sink/source server.
    Serve(ServeOptions),
    /// A client driven over standard input.
    Client {
        /// The server to connect to.
        address: SocketAddr,
        /// The largest object a phase may move.
        object_max_bytes: usize,
    },
}

impl PartialEq for ServeOptions {
    fn eq(&self, other: &Self) -> bool {
        (self.object_max_bytes, self.parent_pid, self.lifetime_ms)
            == (other.object_max_bytes, other.parent_pid, other.lifetime_ms)
    }
}

/// Parse the arguments after the program name.
pub fn parse(args: &[String]) -> Result<Command, Error> {
    let (command, rest) = args.split_first().ok_or(Error::Usage)?;
    let allowed: &[&'static str] = match command.as_str() {
        "serve" => &["--object-max-bytes", "--parent-pid", "--lifetime-s"],
        "client" => &["--connect", "--object-max-bytes"],
        _ => return Err(Error::Usage),
    };
    let mut values: Vec<(&'static str, &str)> = Vec::new();
    let mut words = rest.iter();
    while let Some(flag) = words.next() {
        let name = allowed
            .iter()
            .copied()
            .find(|name| name == flag)
            .ok_or_else(|| Error::UnknownFlag(flag.clone()))?;
        let value = words.next().ok_or(Error::MissingFlag(name))?;
        values.push((name, value));
    }
    let get = |name: &'static str| {
        values
            .iter()
            .rev()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| *v)
    };
    let parsed = |name: &'static str| -> Result<usize, Error> {
        let text = get(name).ok_or(Error::MissingFlag(name))?;
        text.parse().map_err(|_| Error::BadValue {
            flag: name,
            value: text.to_string(),
        })
    };
    let object_max_bytes = parsed("--object-max-bytes")?;
    if command == "serve" {
        let parent_pid = match get("--parent-pid") {
            None => None,
            Some(text) => Some(text.parse().map_err(|_| Error::BadValue {
                flag: "--parent-pid",
                value: text.to_string(),
            })?),
        };
        let lifetime_s = match get("--lifetime-s") {
            None => LIFETIME_S_DEFAULT,
            Some(text) => text
                .parse::<f64>()
                .ok()
                .filter(|s| s.is_finite() && *s > 0.0)
                .ok_or_else(|| Error::BadValue {
                    flag: "--lifetime-s",
                    value: text.to_string(),
                })?,
        };
        return Ok(Command::Serve(ServeOptions {
            object_max_bytes,
            parent_pid,
            lifetime_ms: (lifetime_s * 1000.0) as u64,
        }));
    }
    let text = get("--connect").ok_or(Error::MissingFlag("--connect"))?;
    let address = text.parse().map_err(|_| Error::BadValue {
        flag: "--connect",
        value: text.to_string(),
    })?;
    Ok(Command::Client {
        address,
        object_max_bytes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(text: &str) -> Vec<String> {
        text.split_whitespace().map(str::to_string).collect()
    }

    #[test]
    fn serve_and_client_parse() {
        assert_eq!(
            parse(&args(
                "serve --object-max-bytes 64 --parent-pid 7 --lifetime-s 0.5"
            ))
            .unwrap(),
            Command::Serve(ServeOptions {
                object_max_bytes: 64,
                parent_pid: Some(7),
                lifetime_ms: 500,
            })
        );
        assert_eq!(
            parse(&args("client --connect 127.0.0.1:9 --object-max-bytes 8")).unwrap(),
            Command::Client {
                address: "127.0.0.1:9".parse().unwrap(),
                object_max_bytes: 8,
            }
        );
    }

    #[test]
    fn bad_command_lines_are_refused() {
        assert!(matches!(parse(&[]), Err(Error::Usage)));
        assert!(matches!(parse(&args("listen")), Err(Error::Usage)));
        assert!(matches!(
            parse(&args("serve")),
            Err(Error::MissingFlag("--object-max-bytes"))
        ));
        assert!(matches!(
            parse(&args("serve --object-max-bytes 1 --connect x")),
            Err(Error::UnknownFlag(_))
        ));
        assert!(matches!(
            parse(&args("serve --object-max-bytes")),
            Err(Error::MissingFlag(_))
        ));
        assert!(matches!(
            parse(&args("serve --object-max-bytes 1 --lifetime-s -2")),
            Err(Error::BadValue { .. })
        ));
        assert!(matches!(
            parse(&args("client --object-max-bytes 1 --connect nowhere")),
            Err(Error::BadValue { .. })
        ));
    }
}
