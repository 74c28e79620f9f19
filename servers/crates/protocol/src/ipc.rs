//! Zero-copy codec of the record batches of DoPut and DoGet: one row of one binary column
//! named `data`, decoded straight from the IPC flatbuffer header and body.

use std::sync::{Arc, OnceLock};

use arrow_flight::{FlightData, SchemaAsIpc};
use arrow_ipc::writer::IpcWriteOptions;
use arrow_ipc::{MessageHeader, MetadataVersion};
use arrow_schema::{DataType, Field, Schema};
use bytes::{BufMut, Bytes, BytesMut};

/// Why a DoPut message is not the expected schema or one-row binary batch.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum IpcError {
    /// The IPC header is not a valid flatbuffer Message.
    #[error("IPC message header does not parse")]
    BadHeader,
    /// The message is of another type than expected.
    #[error("expected an IPC {expected} message")]
    WrongMessage {
        /// What was expected.
        expected: &'static str,
    },
    /// The schema is not one binary column.
    #[error("schema must be one binary column named \"data\"")]
    WrongSchema,
    /// The batch is not one non-null row.
    #[error("record batch must hold exactly one non-null row, got {rows} rows with {nulls} nulls")]
    WrongShape {
        /// Rows in the batch.
        rows: i64,
        /// Null values.
        nulls: i64,
    },
    /// Compressed batches are not accepted.
    #[error("compressed IPC bodies are not accepted")]
    Compressed,
    /// A buffer lies outside the body or the offsets point outside the values.
    #[error("IPC buffers are inconsistent with the body of {0} bytes")]
    BadBuffers(usize),
}

/// The schema of DoPut and DoGet streams.
pub fn piece_schema() -> Arc<Schema> {
    static SCHEMA: OnceLock<Arc<Schema>> = OnceLock::new();
    SCHEMA
        .get_or_init(|| {
            Arc::new(Schema::new(vec![Field::new(
                "data",
                DataType::Binary,
                false,
            )]))
        })
        .clone()
}

/// The schema message that opens a DoGet stream.
pub fn schema_flight_data() -> FlightData {
    let options = IpcWriteOptions::default();
    FlightData::from(SchemaAsIpc::new(&piece_schema(), &options))
}

/// Check that an IPC schema message describes one binary column.
pub fn check_schema(data_header: &[u8]) -> Result<(), IpcError> {
    let message = arrow_ipc::root_as_message(data_header).map_err(|_| IpcError::BadHeader)?;
    let schema = message
        .header_as_schema()
        .ok_or(IpcError::WrongMessage { expected: "schema" })?;
    let fields = schema.fields().ok_or(IpcError::WrongSchema)?;
    if fields.len() != 1 || fields.get(0).type_type() != arrow_ipc::Type::Binary {
        return Err(IpcError::WrongSchema);
    }
    Ok(())
}

/// Whether an IPC header is a schema message (as opposed to a record batch).
pub fn is_schema_message(data_header: &[u8]) -> bool {
    arrow_ipc::root_as_message(data_header).is_ok_and(|m| m.header_type() == MessageHeader::Schema)
}

/// The one value of a one-row binary record batch, as a slice of the message body (no copy).
pub fn decode_piece(data_header: &[u8], body: &Bytes) -> Result<Bytes, IpcError> {
    let message = arrow_ipc::root_as_message(data_header).map_err(|_| IpcError::BadHeader)?;
    let batch = message
        .header_as_record_batch()
        .ok_or(IpcError::WrongMessage {
            expected: "record batch",
        })?;
    if batch.compression().is_some() {
        return Err(IpcError::Compressed);
    }
    let nodes = batch.nodes().ok_or(IpcError::WrongShape {
        rows: batch.length(),
        nulls: 0,
    })?;
    if nodes.len() != 1 {
        return Err(IpcError::WrongSchema);
    }
    let node = nodes.get(0);
    if batch.length() != 1 || node.length() != 1 || node.null_count() != 0 {
        return Err(IpcError::WrongShape {
            rows: node.length(),
            nulls: node.null_count(),
        });
    }
    let bad = || IpcError::BadBuffers(body.len());
    let buffers = batch.buffers().ok_or_else(bad)?;
    if buffers.len() != 3 {
        return Err(bad());
    }
    let range = |i: usize| -> Result<(usize, usize), IpcError> {
        let buffer = buffers.get(i);
        let start = usize::try_from(buffer.offset()).map_err(|_| bad())?;
        let len = usize::try_from(buffer.length()).map_err(|_| bad())?;
        let end = start
            .checked_add(len)
            .filter(|end| *end <= body.len())
            .ok_or_else(bad)?;
        Ok((start, end))
    };
    let (offsets_start, offsets_end) = range(1)?;
    let (values_start, values_end) = range(2)?;
    if offsets_end - offsets_start < 8 {
        return Err(bad());
    }
    let offset_at = |at: usize| i32::from_le_bytes(body[at..at + 4].try_into().expect("4 bytes"));
    let first = usize::try_from(offset_at(offsets_start)).map_err(|_| bad())?;
    let last = usize::try_from(offset_at(offsets_start + 4)).map_err(|_| bad())?;
    if first > last || values_start + last > values_end {
        return Err(bad());
    }
    Ok(body.slice(values_start + first..values_start + last))
}

fn pad8(len: usize) -> usize {
    len.div_ceil(8) * 8
}

/// Bytes of a piece's body before its value: the offsets buffer `[0, value length]`.
pub const PIECE_BODY_PREFIX_BYTES: usize = 8;

/// A one-row binary record batch of a `value_len`-byte value, apart from the value itself.
///
/// The message body is `body_prefix`, then the value, then `padding_bytes` zeros (Arrow IPC pads
/// each buffer to 8 bytes). A sender that lays these end to end on the wire hands its transport
/// the value's own bytes instead of copying them into a new body; [`encode_piece`] is the
/// copying form.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PieceFrame {
    /// The IPC message header (a flatbuffer `Message` of a `RecordBatch`).
    pub data_header: Bytes,
    /// The body's first bytes: the offsets buffer.
    pub body_prefix: [u8; PIECE_BODY_PREFIX_BYTES],
    /// Zero bytes after the value that end the body on an 8-byte boundary (0..=7).
    pub padding_bytes: usize,
}

impl PieceFrame {
    /// The frame of a value of `value_len` bytes (at most `BATCH_MAX_BYTES`).
    pub fn new(value_len: usize) -> Self {
        let value_len_i32 = i32::try_from(value_len).expect("a piece is at most BATCH_MAX_BYTES");
        let mut body_prefix = [0u8; PIECE_BODY_PREFIX_BYTES];
        body_prefix[4..].copy_from_slice(&value_len_i32.to_le_bytes());
        let body_len = PIECE_BODY_PREFIX_BYTES + pad8(value_len);

        let mut fbb = flatbuffers::FlatBufferBuilder::with_capacity(256);
        let nodes = fbb.create_vector(&[arrow_ipc::FieldNode::new(1, 0)]);
        let buffers = fbb.create_vector(&[
            arrow_ipc::Buffer::new(0, 0),
            arrow_ipc::Buffer::new(0, PIECE_BODY_PREFIX_BYTES as i64),
            arrow_ipc::Buffer::new(PIECE_BODY_PREFIX_BYTES as i64, value_len as i64),
        ]);
        let batch = arrow_ipc::RecordBatch::create(
            &mut fbb,
            &arrow_ipc::RecordBatchArgs {
                length: 1,
                nodes: Some(nodes),
                buffers: Some(buffers),
                ..Default::default()
            },
        );
        let message = arrow_ipc::Message::create(
            &mut fbb,
            &arrow_ipc::MessageArgs {
                version: MetadataVersion::V5,
                header_type: MessageHeader::RecordBatch,
                header: Some(batch.as_union_value()),
                bodyLength: body_len as i64,
                custom_metadata: None,
            },
        );
        fbb.finish(message, None);
        Self {
            data_header: Bytes::copy_from_slice(fbb.finished_data()),
            body_prefix,
            padding_bytes: body_len - PIECE_BODY_PREFIX_BYTES - value_len,
        }
    }

    /// Length of the whole body: prefix, value and padding.
    pub fn body_len(&self, value_len: usize) -> usize {
        PIECE_BODY_PREFIX_BYTES + value_len + self.padding_bytes
    }
}

/// A one-row binary record batch holding `value`, with `app_metadata`. The value is copied once,
/// into the message body (see [`PieceFrame`] for sending it without the copy).
pub fn encode_piece(value: &[u8], app_metadata: Bytes) -> FlightData {
    let frame = PieceFrame::new(value.len());
    let mut body = BytesMut::with_capacity(frame.body_len(value.len()));
    body.put_slice(&frame.body_prefix);
    body.put_slice(value);
    body.put_bytes(0, frame.padding_bytes);
    FlightData {
        flight_descriptor: None,
        data_header: frame.data_header,
        app_metadata,
        data_body: body.freeze(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow_array::{Array, BinaryArray, RecordBatch};

    #[test]
    fn encoded_piece_decodes_with_arrow() {
        let value = b"hello, arrow".to_vec();
        let data = encode_piece(&value, Bytes::from_static(b"meta"));
        let batch = arrow_flight::utils::flight_data_to_arrow_batch(
            &data,
            piece_schema(),
            &Default::default(),
        )
        .expect("arrow decodes our batch");
        let column = batch
            .column(0)
            .as_any()
            .downcast_ref::<BinaryArray>()
            .unwrap();
        assert_eq!(column.len(), 1);
        assert_eq!(column.value(0), value.as_slice());
        assert_eq!(
            decode_piece(&data.data_header, &data.data_body).unwrap(),
            Bytes::from(value)
        );
    }

    #[test]
    fn piece_frames_pad_the_body_to_eight_bytes() {
        for len in [0usize, 1, 7, 8, 9, 4096, 4099] {
            let frame = PieceFrame::new(len);
            assert_eq!(frame.body_len(len) % 8, 0, "value of {len} bytes");
            assert!(frame.padding_bytes < 8);
            let value = vec![0xabu8; len];
            let data = encode_piece(&value, Bytes::new());
            assert_eq!(data.data_header, frame.data_header);
            assert_eq!(data.data_body.len(), frame.body_len(len));
            assert_eq!(
                &data.data_body[..PIECE_BODY_PREFIX_BYTES],
                &frame.body_prefix
            );
        }
    }

    #[test]
    fn arrow_encoded_batch_decodes_zero_copy() {
        let array = BinaryArray::from_vec(vec![b"xyz".as_slice()]);
        let batch = RecordBatch::try_new(piece_schema(), vec![Arc::new(array)]).unwrap();
        let flight =
            arrow_flight::utils::batches_to_flight_data(&piece_schema(), [&batch]).unwrap();
        check_schema(&flight[0].data_header).unwrap();
        assert!(is_schema_message(&flight[0].data_header));
        let body = flight[1].data_body.clone();
        let value = decode_piece(&flight[1].data_header, &body).unwrap();
        assert_eq!(&value[..], b"xyz");
        let body_range = body.as_ptr() as usize..body.as_ptr() as usize + body.len();
        assert!(body_range.contains(&(value.as_ptr() as usize)));
    }

    #[test]
    fn rejects_wrong_batches() {
        let two_rows = BinaryArray::from_vec(vec![b"a".as_slice(), b"b".as_slice()]);
        let batch = RecordBatch::try_new(piece_schema(), vec![Arc::new(two_rows)]).unwrap();
        let flight =
            arrow_flight::utils::batches_to_flight_data(&piece_schema(), [&batch]).unwrap();
        assert!(matches!(
            decode_piece(&flight[1].data_header, &flight[1].data_body),
            Err(IpcError::WrongShape { .. })
        ));
        assert!(matches!(
            decode_piece(&flight[0].data_header, &flight[0].data_body),
            Err(IpcError::WrongMessage { .. })
        ));
        assert_eq!(
            decode_piece(b"garbage", &Bytes::new()),
            Err(IpcError::BadHeader)
        );
        let good = encode_piece(b"abc", Bytes::new());
        let truncated = good.data_body.slice(..4);
        assert!(matches!(
            decode_piece(&good.data_header, &truncated),
            Err(IpcError::BadBuffers(4))
        ));

        let utf8 = Arc::new(Schema::new(vec![Field::new("data", DataType::Utf8, false)]));
        let flight = arrow_flight::utils::batches_to_flight_data(&utf8, []).unwrap();
        assert_eq!(
            check_schema(&flight[0].data_header),
            Err(IpcError::WrongSchema)
        );
        assert!(check_schema(&schema_flight_data().data_header).is_ok());
    }
}
