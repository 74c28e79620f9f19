//! A server's key material, the cluster secret and its TLS identity, read once at start from
//! the files named on the command line or from one document on stdin, and the process made
//! non-dumpable so that another process of the same user cannot read them back.
//!
//! The stdin document is one JSON object, read up to its end (stdin may stay open):
//! `{"secret_hex": "<hex of the secret's bytes>", "tls_cert_pem": "<PEM chain>",
//! "tls_key_pem": "<PEM key>"}`; both TLS fields or neither, no other field.

use std::io::Read;
use std::path::Path;
use std::sync::Arc;

use pocketflow_flight::tls::{server_config, server_config_from_pem, TLS_FILE_MAX_BYTES};
use pocketflow_protocol::token::TokenKey;
use rustls::ServerConfig;

use crate::args::KeySource;

/// Largest keys document read from stdin: a certificate chain and a key at their own bound,
/// and a secret.
pub const KEYS_DOCUMENT_MAX_BYTES: u64 = 2 * TLS_FILE_MAX_BYTES + 64 * 1024;

/// Largest cluster secret file read (a secret is tens of bytes).
pub const SECRET_FILE_MAX_BYTES: u64 = 64 * 1024;

/// What a server's keys become: the token key and, with TLS, the listener's configuration.
pub struct Keys {
    /// Checks (and makes) capability tokens.
    pub token_key: TokenKey,
    /// The TLS configuration of the listeners, if the server has an identity.
    pub tls: Option<Arc<ServerConfig>>,
}

/// The keys document on stdin.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct KeysDocument {
    secret_hex: String,
    tls_cert_pem: Option<String>,
    tls_key_pem: Option<String>,
}

/// Key material that cannot be used, with a message naming its source and the cause.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct KeysError(String);

/// Mark the process non-dumpable (`PR_SET_DUMPABLE` 0): no core dump, and another process of
/// the same user can neither ptrace it nor read its memory or environment through /proc (those
/// files become root's). Called first thing, before any key is read.
pub fn forbid_dumps() -> std::io::Result<()> {
    // SAFETY: prctl with PR_SET_DUMPABLE only changes a flag of this process.
    let done = unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0) };
    if done != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Read the keys from `source`; `stdin` is read only for [`KeySource::Stdin`].
pub fn load(source: &KeySource, stdin: impl Read) -> Result<Keys, KeysError> {
    match source {
        KeySource::Files { secret, tls } => {
            let secret_bytes = read_secret_file(secret)?;
            let token_key = TokenKey::new(&secret_bytes)
                .map_err(|e| KeysError(format!("--secret-file {}: {e}", secret.display())))?;
            let tls = match tls {
                Some(files) => Some(
                    server_config(&files.cert, &files.key).map_err(|e| KeysError(e.to_string()))?,
                ),
                None => None,
            };
            Ok(Keys { token_key, tls })
        }
        KeySource::Stdin => from_document(stdin),
    }
}

fn read_secret_file(path: &Path) -> Result<Vec<u8>, KeysError> {
    let cannot =
        |e: std::io::Error| KeysError(format!("cannot read --secret-file {}: {e}", path.display()));
    let mut bytes = Vec::new();
    std::fs::File::open(path)
        .map_err(cannot)?
        .take(SECRET_FILE_MAX_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(cannot)?;
    if bytes.len() as u64 > SECRET_FILE_MAX_BYTES {
        return Err(KeysError(format!(
            "--secret-file {} is over the {SECRET_FILE_MAX_BYTES}-byte bound",
            path.display()
        )));
    }
    Ok(bytes)
}

/// The keys of the first JSON document of `stdin` (read no further than its end).
fn from_document(stdin: impl Read) -> Result<Keys, KeysError> {
    let bounded = stdin.take(KEYS_DOCUMENT_MAX_BYTES);
    let first = serde_json::Deserializer::from_reader(bounded)
        .into_iter::<KeysDocument>()
        .next();
    let document = match first {
        Some(Ok(document)) => document,
        Some(Err(e)) if e.is_eof() => {
            return Err(KeysError(format!(
                "--keys-from-stdin: stdin ended inside the keys document, or it is over the \
                 {KEYS_DOCUMENT_MAX_BYTES}-byte bound"
            )))
        }
        Some(Err(e)) => {
            return Err(KeysError(format!(
                "--keys-from-stdin: not a keys document ({e})"
            )))
        }
        None => {
            return Err(KeysError(format!(
                "--keys-from-stdin: stdin ended before the keys document, or held none in its \
                 first {KEYS_DOCUMENT_MAX_BYTES} bytes (the bound)"
            )))
        }
    };
    let secret = hex::decode(&document.secret_hex)
        .map_err(|e| KeysError(format!("--keys-from-stdin: secret_hex is not hex: {e}")))?;
    let token_key = TokenKey::new(&secret)
        .map_err(|e| KeysError(format!("--keys-from-stdin: secret_hex: {e}")))?;
    let tls = match (document.tls_cert_pem, document.tls_key_pem) {
        (Some(cert), Some(key)) => Some(
            server_config_from_pem(
                cert.as_bytes(),
                key.as_bytes(),
                "tls_cert_pem of the keys document",
                "tls_key_pem of the keys document",
            )
            .map_err(|e| KeysError(e.to_string()))?,
        ),
        (None, None) => None,
        _ => {
            return Err(KeysError(
                "--keys-from-stdin: tls_cert_pem and tls_key_pem come together".into(),
            ))
        }
    };
    Ok(Keys { token_key, tls })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load_stdin(text: &str) -> Result<Keys, KeysError> {
        load(&KeySource::Stdin, text.as_bytes())
    }

    #[test]
    fn a_document_with_a_secret_gives_its_token_key() {
        let secret = b"a-secret-of-at-least-16-bytes";
        let keys = load_stdin(&format!(
            "{{\"secret_hex\": \"{}\"}}\nnot read",
            hex::encode(secret)
        ))
        .unwrap();
        assert!(keys.tls.is_none());
        let expected = TokenKey::new(secret).unwrap();
        let token = expected.make("job", u64::MAX / 2);
        assert!(keys.token_key.verify("job", &token, 0).is_ok());
    }

    #[test]
    fn bad_documents_are_refused_with_their_cause() {
        let secret_hex = hex::encode(b"a-secret-of-at-least-16-bytes");
        for (text, cause) in [
            ("", "ended before"),
            ("{\"secret_hex\": \"ab", "ended inside"),
            ("[1, 2]", "not a keys document"),
            ("{\"secret_hex\": \"zz\"}", "not hex"),
            ("{\"secret_hex\": \"abcd\"}", "secret_hex"),
            (
                &format!("{{\"secret_hex\": \"{secret_hex}\", \"extra\": 1}}"),
                "unknown field",
            ),
            (
                &format!("{{\"secret_hex\": \"{secret_hex}\", \"tls_cert_pem\": \"x\"}}"),
                "come together",
            ),
            (
                &format!(
                    "{{\"secret_hex\": \"{secret_hex}\", \"tls_cert_pem\": \"x\", \
                     \"tls_key_pem\": \"y\"}}"
                ),
                "tls_cert_pem of the keys document",
            ),
        ] {
            let error = load_stdin(text).err().unwrap_or_else(|| panic!("{text}"));
            assert!(error.to_string().contains(cause), "{text}: {error}");
        }
    }

    #[test]
    fn a_document_past_its_bound_is_refused() {
        let padding = " ".repeat(KEYS_DOCUMENT_MAX_BYTES as usize);
        let error = load_stdin(&format!("{padding}{{\"secret_hex\": \"00\"}}"))
            .err()
            .unwrap();
        assert!(error.to_string().contains("bound"), "{error}");
    }
}
