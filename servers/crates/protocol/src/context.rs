//! The capability context `{job, epoch, token}` every request carries, and the name rules shared
//! by all JSON requests.

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::error::ProtocolError;
use crate::limits::{BUCKET_NAME_MAX_BYTES, JOB_ID_MAX_BYTES, KEY_MAX_BYTES};

/// Who is asking: the job, the weight-map epoch it uses and its capability token.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Context {
    /// Job id (or `ADMIN_JOB_ID` for control-plane requests).
    pub job: String,
    /// Weight-map epoch the client placed the request with.
    #[serde(default)]
    pub epoch: u64,
    /// Capability token for `job`. Missing is empty; a value that is not a string is kept as
    /// text that is no token, so both are refused as `permission_denied` by the token check,
    /// not as a malformed body.
    #[serde(default, deserialize_with = "token_text")]
    pub token: String,
}

/// Any JSON value as token text: a string as it is, anything else as a marker that never parses
/// as a token.
fn token_text<'de, D: serde::Deserializer<'de>>(deserializer: D) -> Result<String, D::Error> {
    match serde_json::Value::deserialize(deserializer)? {
        serde_json::Value::String(text) => Ok(text),
        serde_json::Value::Null => Ok(String::new()),
        _ => Ok(NOT_A_STRING_TOKEN.to_string()),
    }
}

/// What a token that was not a JSON string becomes.
const NOT_A_STRING_TOKEN: &str = "(not a string)";

impl Context {
    /// Check the job id's bounds (the token is checked by the service, which holds the secret).
    pub fn validate(&self) -> Result<(), ProtocolError> {
        check_job_id(&self.job)
    }
}

/// A job id is 1..=`JOB_ID_MAX_BYTES` bytes without control characters (the token MAC uses a
/// newline as separator).
pub fn check_job_id(job: &str) -> Result<(), ProtocolError> {
    check_name("job", job, JOB_ID_MAX_BYTES)?;
    if job.chars().any(char::is_control) {
        return Err(ProtocolError::NotText("job"));
    }
    Ok(())
}

/// A bucket name is 1..=`BUCKET_NAME_MAX_BYTES` bytes.
pub fn check_bucket(bucket: &str) -> Result<(), ProtocolError> {
    check_name("bucket", bucket, BUCKET_NAME_MAX_BYTES)
}

/// A key is 1..=`KEY_MAX_BYTES` bytes.
pub fn check_key(key: &str) -> Result<(), ProtocolError> {
    check_name("key", key, KEY_MAX_BYTES)
}

/// A key prefix is 0..=`KEY_MAX_BYTES` bytes.
pub fn check_prefix(prefix: &str) -> Result<(), ProtocolError> {
    if prefix.len() > KEY_MAX_BYTES {
        return Err(ProtocolError::Length {
            what: "prefix",
            len: prefix.len() as u64,
            min: 0,
            max: KEY_MAX_BYTES as u64,
        });
    }
    Ok(())
}

fn check_name(what: &'static str, name: &str, max: usize) -> Result<(), ProtocolError> {
    if name.is_empty() || name.len() > max {
        return Err(ProtocolError::Length {
            what,
            len: name.len() as u64,
            min: 1,
            max: max as u64,
        });
    }
    Ok(())
}

/// Parse a JSON request body, naming `what` in the error.
pub fn parse_json<T: DeserializeOwned>(
    what: &'static str,
    body: &[u8],
) -> Result<T, ProtocolError> {
    serde_json::from_slice(body).map_err(|source| ProtocolError::Json { what, source })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn context_parses_and_validates() {
        let ctx: Context =
            parse_json("ctx", br#"{"job":"j","epoch":3,"token":"t","extra":1}"#).unwrap();
        assert_eq!(
            ctx,
            Context {
                job: "j".into(),
                epoch: 3,
                token: "t".into()
            }
        );
        assert!(ctx.validate().is_ok());
        let bad = Context {
            job: String::new(),
            epoch: 0,
            token: String::new(),
        };
        assert!(matches!(
            bad.validate(),
            Err(ProtocolError::Length { what: "job", .. })
        ));
        let newline = Context {
            job: "a\nb".into(),
            epoch: 0,
            token: String::new(),
        };
        assert!(matches!(
            newline.validate(),
            Err(ProtocolError::NotText("job"))
        ));
        let long = Context {
            job: "j".repeat(JOB_ID_MAX_BYTES + 1),
            epoch: 0,
            token: String::new(),
        };
        assert!(long.validate().is_err());
        assert!(matches!(
            parse_json::<Context>("ctx", b"{"),
            Err(ProtocolError::Json { what: "ctx", .. })
        ));
        // A token that is missing, null or not a string parses (the token check refuses it).
        for body in [
            &br#"{"job":"j"}"#[..],
            br#"{"job":"j","token":null}"#,
            br#"{"job":"j","token":12}"#,
            br#"{"job":"j","token":{"a":1}}"#,
        ] {
            let ctx: Context = parse_json("ctx", body).unwrap();
            assert!(ctx.token.is_empty() || ctx.token == NOT_A_STRING_TOKEN);
        }
    }

    #[test]
    fn names() {
        assert!(check_bucket("b").is_ok());
        assert!(check_bucket("").is_err());
        assert!(check_bucket(&"b".repeat(256)).is_err());
        assert!(check_key(&"k".repeat(1024)).is_ok());
        assert!(check_key(&"k".repeat(1025)).is_err());
        assert!(check_prefix("").is_ok());
        assert!(check_prefix(&"p".repeat(1025)).is_err());
    }
}
