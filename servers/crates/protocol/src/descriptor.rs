//! The JSON FlightDescriptor commands that open a DoExchange session and a DoPut upload, and
//! the upload's JSON result.

use serde::{Deserialize, Serialize};

use crate::context::{check_bucket, check_key, parse_json, Context};
use crate::error::ProtocolError;
use crate::header::{ObjectHeader, HEADER_FLAG_PERSIST};
use crate::limits::{BLOCK_SIZE_MAX_BYTES, SMALL_OBJECT_MAX_BYTES};

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
    /// Store the object's manifest once the upload's blocks are stored: the upload then carries
    /// every data block of the object, and its result says whether the manifest was stored.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub commit: Option<PutCommit>,
}

/// The manifest an upload stores after its blocks (docs/PROTOCOL.md, "DoPut"): that of an object
/// of `size` bytes in blocks of the descriptor's `block_size`, with the descriptor's version and
/// PERSIST flag.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PutCommit {
    /// Size of the object in bytes.
    pub size: u64,
    /// Whether the manifest may replace an object of the same key (the OVERWRITE op flag).
    #[serde(default)]
    pub overwrite: bool,
}

impl PutDescriptor {
    /// The manifest header the upload's commit stores, if it has one.
    pub fn manifest(&self) -> Option<ObjectHeader> {
        let commit = self.commit?;
        Some(ObjectHeader {
            version: self.version,
            size: commit.size,
            block_count: commit
                .size
                .div_ceil(u64::from(self.block_size))
                .try_into()
                .unwrap_or(u32::MAX),
            block_size: self.block_size,
            flags: if self.persist { HEADER_FLAG_PERSIST } else { 0 },
        })
    }

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
        if let Some(manifest) = descriptor.manifest() {
            if manifest.size <= SMALL_OBJECT_MAX_BYTES {
                return Err(ProtocolError::Field {
                    what: "commit",
                    why: "size must be above SMALL_OBJECT_MAX_BYTES (a small object is a record)",
                });
            }
            manifest.validate()?;
        }
        Ok(descriptor)
    }
}

/// The result of an upload (DoPut's PutResult `app_metadata`, the direct exchange's STORED).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PutStored {
    /// Blocks stored.
    pub blocks: u64,
    /// Bytes stored.
    pub bytes: u64,
    /// Whether the upload's commit stored the manifest (absent without a commit).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub committed: bool,
    /// The header of the object the commit replaced (an overwrite that found one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replaced: Option<ObjectHeader>,
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

    #[test]
    fn put_descriptor_commit() {
        let with = |commit: &str| {
            format!(
                r#"{{"ctx":{CTX},"bucket":"b","key":"k","version":5,"block_size":1048576,"persist":true,"commit":{commit}}}"#
            )
        };
        let d = PutDescriptor::parse(with(r#"{"size":2097153}"#).as_bytes()).unwrap();
        assert_eq!(
            d.manifest(),
            Some(ObjectHeader {
                version: 5,
                size: 2_097_153,
                block_count: 3,
                block_size: 1 << 20,
                flags: HEADER_FLAG_PERSIST,
            })
        );
        assert!(!d.commit.unwrap().overwrite);
        // A small object is a record; blocks beyond u32 do not fit a header.
        for bad in [r#"{"size":65536}"#, r#"{"size":9007199254740993}"#, r#"{}"#] {
            assert!(PutDescriptor::parse(with(bad).as_bytes()).is_err(), "{bad}");
        }
        let plain =
            format!(r#"{{"ctx":{CTX},"bucket":"b","key":"k","version":5,"block_size":1048576}}"#);
        assert_eq!(
            PutDescriptor::parse(plain.as_bytes()).unwrap().manifest(),
            None
        );
    }

    #[test]
    fn put_stored_leaves_out_what_it_lacks() {
        let plain = PutStored {
            blocks: 2,
            bytes: 10,
            ..Default::default()
        };
        assert_eq!(
            serde_json::to_string(&plain).unwrap(),
            r#"{"blocks":2,"bytes":10}"#
        );
        let replaced = ObjectHeader {
            version: 9,
            size: 3,
            ..Default::default()
        };
        let committed = PutStored {
            committed: true,
            replaced: Some(replaced),
            ..plain
        };
        let text = serde_json::to_string(&committed).unwrap();
        assert_eq!(serde_json::from_str::<PutStored>(&text).unwrap(), committed);
    }
}
