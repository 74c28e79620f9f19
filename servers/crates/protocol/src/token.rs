//! Capability tokens: `"<expiry_unix_ms>.<hex(HMAC-SHA256(secret, job + "\n" + expiry_unix_ms))>"`.

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::error::TokenError;

/// Shortest cluster secret accepted.
pub const SECRET_MIN_BYTES: usize = 16;
/// Hex digits of the MAC part of a token.
const MAC_HEX_LEN: usize = 64;
/// Most decimal digits of the expiry part (u64::MAX has 20).
const EXPIRY_DIGITS_MAX: usize = 20;

/// The cluster secret, keyed once, that makes and verifies capability tokens.
#[derive(Clone)]
pub struct TokenKey {
    mac: Hmac<Sha256>,
}

impl std::fmt::Debug for TokenKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TokenKey(..)")
    }
}

impl TokenKey {
    /// Key the MAC with the secret's exact bytes (at least [`SECRET_MIN_BYTES`]).
    pub fn new(secret: &[u8]) -> Result<Self, TokenError> {
        if secret.len() < SECRET_MIN_BYTES {
            return Err(TokenError::SecretTooShort(secret.len()));
        }
        let mac = Hmac::<Sha256>::new_from_slice(secret).expect("HMAC accepts keys of any length");
        Ok(Self { mac })
    }

    fn mac_for(&self, job: &str, expiry_unix_ms: u64) -> Hmac<Sha256> {
        let mut mac = self.mac.clone();
        mac.update(job.as_bytes());
        mac.update(b"\n");
        mac.update(expiry_unix_ms.to_string().as_bytes());
        mac
    }

    /// A token for `job` valid until `expiry_unix_ms`.
    pub fn make(&self, job: &str, expiry_unix_ms: u64) -> String {
        let tag = self.mac_for(job, expiry_unix_ms).finalize().into_bytes();
        format!("{expiry_unix_ms}.{}", hex::encode(tag))
    }

    /// Check that `token` was made for `job` with this key and has not expired at `now_unix_ms`;
    /// returns its expiry. The MAC comparison is constant-time; the expiry is only reported for
    /// authentic tokens.
    pub fn verify(&self, job: &str, token: &str, now_unix_ms: u64) -> Result<u64, TokenError> {
        if token.is_empty() {
            return Err(TokenError::Missing);
        }
        let (expiry_text, mac_hex) = token.split_once('.').ok_or(TokenError::Malformed)?;
        let digits_ok = !expiry_text.is_empty()
            && expiry_text.len() <= EXPIRY_DIGITS_MAX
            && expiry_text.bytes().all(|b| b.is_ascii_digit());
        if !digits_ok || mac_hex.len() != MAC_HEX_LEN {
            return Err(TokenError::Malformed);
        }
        let expiry_unix_ms: u64 = expiry_text.parse().map_err(|_| TokenError::Malformed)?;
        // A canonical decimal only: "007" would sign differently from "7".
        if expiry_unix_ms.to_string() != expiry_text {
            return Err(TokenError::Malformed);
        }
        let tag = hex::decode(mac_hex).map_err(|_| TokenError::Malformed)?;
        self.mac_for(job, expiry_unix_ms)
            .verify_slice(&tag)
            .map_err(|_| TokenError::Mismatch(job.to_owned()))?;
        if now_unix_ms >= expiry_unix_ms {
            return Err(TokenError::Expired {
                expiry_unix_ms,
                now_unix_ms,
            });
        }
        Ok(expiry_unix_ms)
    }
}

/// Milliseconds since the Unix epoch by the system clock.
pub fn now_unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECRET: &[u8] = b"0123456789abcdef-secret";

    #[test]
    fn good_token_verifies() {
        let key = TokenKey::new(SECRET).unwrap();
        let token = key.make("job-1", 2_000);
        assert!(token.starts_with("2000."));
        assert_eq!(token.len(), 5 + 64);
        assert_eq!(key.verify("job-1", &token, 1_999), Ok(2_000));
        assert_eq!(key.verify("job-1", &token.to_uppercase(), 1_000), Ok(2_000));
    }

    #[test]
    fn known_vector() {
        // HMAC-SHA256(key, "job\n5") computed independently with Python's hmac module.
        let key = TokenKey::new(b"sixteen-byte-key").unwrap();
        let token = key.make("job", 5);
        let expected = "5.ef239cbb81dd9c7fc873f299e7e0ac068c436c34ee8badab44aca5ee775cb5ed";
        assert_eq!(token, expected);
    }

    #[test]
    fn bad_tokens_are_refused() {
        let key = TokenKey::new(SECRET).unwrap();
        let token = key.make("job-1", 2_000);
        assert_eq!(key.verify("job-1", "", 0), Err(TokenError::Missing));
        assert_eq!(key.verify("job-1", "nodot", 0), Err(TokenError::Malformed));
        assert_eq!(key.verify("job-1", "12.abc", 0), Err(TokenError::Malformed));
        assert_eq!(
            key.verify("job-1", &format!("x{token}"), 0),
            Err(TokenError::Malformed)
        );
        assert_eq!(
            key.verify("job-1", &format!("0{token}"), 0),
            Err(TokenError::Malformed)
        );
        let not_hex = format!("2000.{}", "z".repeat(64));
        assert_eq!(key.verify("job-1", &not_hex, 0), Err(TokenError::Malformed));
        assert_eq!(
            key.verify("job-2", &token, 0),
            Err(TokenError::Mismatch("job-2".into()))
        );
        let other_key = TokenKey::new(b"another-secret-of-16").unwrap();
        assert!(matches!(
            other_key.verify("job-1", &token, 0),
            Err(TokenError::Mismatch(_))
        ));
        let later_expiry = token.replacen("2000", "3000", 1);
        assert!(matches!(
            key.verify("job-1", &later_expiry, 0),
            Err(TokenError::Mismatch(_))
        ));
    }

    #[test]
    fn expired_token_is_refused() {
        let key = TokenKey::new(SECRET).unwrap();
        let token = key.make("job-1", 2_000);
        assert_eq!(
            key.verify("job-1", &token, 2_000),
            Err(TokenError::Expired {
                expiry_unix_ms: 2_000,
                now_unix_ms: 2_000
            })
        );
    }

    #[test]
    fn short_secret_is_refused() {
        assert_eq!(
            TokenKey::new(b"short").unwrap_err(),
            TokenError::SecretTooShort(5)
        );
    }
}
