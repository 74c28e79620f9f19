//! The JSON FlightDescriptor commands that open a DoExchange session and a DoPut upload.

use serde::{Deserialize, Serialize};

use crate::context::{check_bucket, check_key, parse_json, Context};
use crate::error::ProtocolError;
use crate::limits::BLOCK_SIZE_MAX_BYTES;

/// Command of the descriptor that opens a DoExchange session.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExchangeDescriptor {
    /// Whose session this is; every frame belongs to this job.
    pub ctx: Context,
}

impl ExchangeDescriptor {
    /// Parse and validate the descriptor command.
    pub fn parse(cmd: &[u8]) -> Result<Self, ProtocolError> {
        let descriptor: Self = parse_json("exchange descriptor", cmd)?;
        descriptor.ctx.validate()?;
        Ok(descriptor)
    }
}

/// Command of the descriptor of a DoPut stream of data blocks.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PutDescriptor {
    /// Whose data this is.
    pub ctx: Context,
    /// Bucket of the object.
    pub bucket: String,
    /// Key of the object.
    pub key: String,
    /// Writer-chosen non-zero version of this put.
    pub version: u64,
    /// Bytes per data block of the object.
    pub block_size: u32,
    /// Whether the object is PERSIST.
    #[serde(default)]
    pub persist: bool,
}

impl PutDescriptor {
    /// Parse and validate the descriptor command.
    pub fn parse(cmd: &[u8]) -> Result<Self, ProtocolError> {
        let descriptor: Self = parse_json("put descriptor", cmd)?;
        descriptor.ctx.validate()?;
        check_bucket(&descriptor.bucket)?;
        check_key(&descriptor.key)?;
        if descriptor.version == 0 {
            return Err(ProtocolError::Field {
                what: "version",
                why: "must be non-zero",
            });
        }
        if descriptor.block_size == 0 || descriptor.block_size > BLOCK_SIZE_MAX_BYTES {
            return Err(ProtocolError::Field {
                what: "block_size",
                why: "must be in 1..=BLOCK_SIZE_MAX_BYTES",
            });
        }
        Ok(descriptor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CTX: &str = r#"{"job":"j","epoch":1,"token":"t"}"#;

    #[test]
    fn exchange_descriptor() {
        let d = ExchangeDescriptor::parse(format!(r#"{{"ctx":{CTX}}}"#).as_bytes()).unwrap();
        assert_eq!(d.ctx.job, "j");
        assert!(ExchangeDescriptor::parse(b"{}").is_err());
        assert!(ExchangeDescriptor::parse(br#"{"ctx":{"job":""}}"#).is_err());
        assert!(ExchangeDescriptor::parse(b"\xff").is_err());
    }

    #[test]
    fn put_descriptor() {
        let ok =
            format!(r#"{{"ctx":{CTX},"bucket":"b","key":"k","version":5,"block_size":1048576}}"#);
        let d = PutDescriptor::parse(ok.as_bytes()).unwrap();
        assert_eq!((d.version, d.block_size, d.persist), (5, 1 << 20, false));
        for bad in [
            format!(r#"{{"ctx":{CTX},"bucket":"b","key":"k","version":0,"block_size":1}}"#),
            format!(r#"{{"ctx":{CTX},"bucket":"b","key":"k","version":1,"block_size":0}}"#),
            format!(r#"{{"ctx":{CTX},"bucket":"b","key":"k","version":1,"block_size":16777217}}"#),
            format!(r#"{{"ctx":{CTX},"bucket":"","key":"k","version":1,"block_size":1}}"#),
            format!(r#"{{"ctx":{CTX},"bucket":"b","key":"","version":1,"block_size":1}}"#),
            format!(r#"{{"ctx":{CTX},"bucket":"b","key":"k","version":-1,"block_size":1}}"#),
            format!(r#"{{"ctx":{CTX},"bucket":"b","key":"k","block_size":1}}"#),
        ] {
            assert!(PutDescriptor::parse(bad.as_bytes()).is_err(), "{bad}");
        }
    }
}
