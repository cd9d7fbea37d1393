//! TensorBoard event files, written as a run goes.
//!
//! An event file is a sequence of TFRecords, each an `Event` protobuf:
//! first a file-version event, then one event a step holding that step's
//! scalars (or a text summary). A record is framed as
//!
//! ```text
//! u64 length (little-endian) | u32 masked CRC-32C of those 8 bytes
//! data                       | u32 masked CRC-32C of the data
//! ```
//!
//! with TensorFlow's mask `((crc >> 15) | (crc << 17)) + 0xa282ead8`.
//! TensorBoard (and W&B's TensorBoard sync) read every file in a directory
//! whose name contains `tfevents`, so a resumed run adds a file of its own
//! and its steps continue the same curves.
//!
//! Writing never holds up a step: [`EventWriter`] hands each event to a
//! thread of its own, which encodes, writes and, at every
//! [`EventWriter::flush`], flushes the file so a TensorBoard pointed at the
//! directory shows the run live. The messages are declared with prost's
//! derive, field numbers as in TensorFlow's `event.proto`, `summary.proto`
//! and `tensor.proto`.

use hybridgen_runtime::checkpoint::crc32c::crc32c;
use prost::Message;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{SystemTime, UNIX_EPOCH};

/// `tensorflow.Event`: the fields hybridgen writes.
#[derive(Clone, PartialEq, Message)]
struct Event {
    #[prost(double, tag = "1")]
    wall_time: f64,
    #[prost(int64, tag = "2")]
    step: i64,
    #[prost(oneof = "What", tags = "3, 5")]
    what: Option<What>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
enum What {
    #[prost(string, tag = "3")]
    FileVersion(String),
    #[prost(message, tag = "5")]
    Summary(Summary),
}

/// `tensorflow.Summary`.
#[derive(Clone, PartialEq, Message)]
struct Summary {
    #[prost(message, repeated, tag = "1")]
    value: Vec<SummaryValue>,
}

/// `tensorflow.Summary.Value`.
#[derive(Clone, PartialEq, Message)]
struct SummaryValue {
    #[prost(string, tag = "1")]
    tag: String,
    #[prost(message, optional, tag = "9")]
    metadata: Option<SummaryMetadata>,
    #[prost(oneof = "Value", tags = "2, 8")]
    value: Option<Value>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
enum Value {
    #[prost(float, tag = "2")]
    SimpleValue(f32),
    #[prost(message, tag = "8")]
    Tensor(TensorProto),
}

/// `tensorflow.SummaryMetadata`.
#[derive(Clone, PartialEq, Message)]
struct SummaryMetadata {
    #[prost(message, optional, tag = "1")]
    plugin_data: Option<PluginData>,
}

/// `tensorflow.SummaryMetadata.PluginData`.
#[derive(Clone, PartialEq, Message)]
struct PluginData {
    #[prost(string, tag = "1")]
    plugin_name: String,
}

/// `tensorflow.TensorProto`: a string tensor, as the text plugin reads it.
#[derive(Clone, PartialEq, Message)]
struct TensorProto {
    #[prost(int32, tag = "1")]
    dtype: i32,
    #[prost(message, optional, tag = "2")]
    tensor_shape: Option<TensorShapeProto>,
    #[prost(bytes = "vec", repeated, tag = "8")]
    string_val: Vec<Vec<u8>>,
}

/// `tensorflow.TensorShapeProto`: a scalar's is empty.
#[derive(Clone, PartialEq, Message)]
struct TensorShapeProto {}

/// `tensorflow.DataType.DT_STRING`.
const DT_STRING: i32 = 7;

/// TensorFlow's masked CRC-32C: a CRC stored beside the data it covers is
/// masked so that the CRC of data containing CRCs stays well distributed.
fn masked_crc(bytes: &[u8]) -> u32 {
    let crc = crc32c(bytes);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

/// One TFRecord around `data`.
fn record(data: &[u8]) -> Vec<u8> {
    let length = (data.len() as u64).to_le_bytes();
    let mut out = Vec::with_capacity(data.len() + 16);
    out.extend_from_slice(&length);
    out.extend_from_slice(&masked_crc(&length).to_le_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(&masked_crc(data).to_le_bytes());
    out
}

/// The largest `<seconds>` among `dir`'s files named
/// `events.out.tfevents.<seconds>...` (others are not ours to order).
fn latest_file_seconds(dir: &Path) -> std::io::Result<Option<u64>> {
    let mut latest = None;
    for entry in std::fs::read_dir(dir)? {
        let name = entry?.file_name();
        let seconds = name
            .to_str()
            .and_then(|n| n.strip_prefix("events.out.tfevents."))
            .and_then(|rest| rest.split('.').next())
            .and_then(|s| s.parse::<u64>().ok());
        latest = latest.max(seconds);
    }
    Ok(latest)
}

fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// What the writing thread is asked to do.
enum Request {
    Write(Event),
    Flush,
}

/// One event file in a directory, written on a thread of its own.
pub struct EventWriter {
    path: PathBuf,
    requests: Option<mpsc::Sender<Request>>,
    thread: Option<JoinHandle<std::io::Result<()>>>,
}

impl EventWriter {
    /// Creates `dir` (and its parents) if needed and a new event file in
    /// it, named as TensorFlow names them (`events.out.tfevents.<seconds>.
    /// <host>.<pid>`), with its file-version event written and flushed:
    /// an unwritable directory fails here, before a run starts.
    ///
    /// TensorBoard reads a directory's files in the order of their names,
    /// so `<seconds>` is past every event file already there: a run resumed
    /// within the second its predecessor started (or on a machine whose
    /// clock is behind) still sorts after it, and its steps continue the
    /// curves instead of coming before them.
    pub fn create(dir: &Path) -> std::io::Result<EventWriter> {
        std::fs::create_dir_all(dir)?;
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_string())
            .ok()
            .filter(|h| !h.is_empty() && h.chars().all(|c| c.is_ascii_alphanumeric() || c == '-'))
            .unwrap_or_else(|| "localhost".to_string());
        let seconds = match latest_file_seconds(dir)? {
            Some(latest) => (now() as u64).max(latest + 1),
            None => now() as u64,
        };
        let name = format!(
            "events.out.tfevents.{seconds}.{host}.{}",
            std::process::id()
        );
        let path = dir.join(name);
        let mut file = BufWriter::new(
            std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&path)?,
        );
        let version = Event {
            wall_time: now(),
            step: 0,
            what: Some(What::FileVersion("brain.Event:2".to_string())),
        };
        file.write_all(&record(&version.encode_to_vec()))?;
        file.flush()?;
        let (requests, queue) = mpsc::channel::<Request>();
        let thread = std::thread::Builder::new()
            .name("tensorboard".into())
            .spawn(move || {
                for request in queue {
                    match request {
                        Request::Write(event) => file.write_all(&record(&event.encode_to_vec()))?,
                        Request::Flush => file.flush()?,
                    }
                }
                file.flush()
            })?;
        Ok(EventWriter {
            path,
            requests: Some(requests),
            thread: Some(thread),
        })
    }

    /// The event file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn send(&self, request: Request) {
        // A writing thread that stopped keeps its error for `close`.
        if let Some(requests) = &self.requests {
            let _ = requests.send(request);
        }
    }

    /// One event at `step` with these scalars (each stored as TensorBoard's
    /// `simple_value`, an f32).
    pub fn scalars(&self, step: u64, scalars: &[(&str, f32)]) {
        let value = scalars
            .iter()
            .map(|&(tag, v)| SummaryValue {
                tag: tag.to_string(),
                metadata: None,
                value: Some(Value::SimpleValue(v)),
            })
            .collect();
        self.send(Request::Write(Event {
            wall_time: now(),
            step: step as i64,
            what: Some(What::Summary(Summary { value })),
        }));
    }

    /// A text summary at `step` (TensorBoard's Text tab renders it as
    /// Markdown).
    pub fn text(&self, step: u64, tag: &str, text: &str) {
        let tensor = TensorProto {
            dtype: DT_STRING,
            tensor_shape: Some(TensorShapeProto {}),
            string_val: vec![text.as_bytes().to_vec()],
        };
        self.send(Request::Write(Event {
            wall_time: now(),
            step: step as i64,
            what: Some(What::Summary(Summary {
                value: vec![SummaryValue {
                    tag: tag.to_string(),
                    metadata: Some(SummaryMetadata {
                        plugin_data: Some(PluginData {
                            plugin_name: "text".to_string(),
                        }),
                    }),
                    value: Some(Value::Tensor(tensor)),
                }],
            })),
        }));
    }

    /// Writes what was queued to the file (on the writing thread; this
    /// call does not wait).
    pub fn flush(&self) {
        self.send(Request::Flush);
    }

    /// Writes everything queued, closes the file and reports the first
    /// write error, if any.
    pub fn close(mut self) -> std::io::Result<()> {
        self.finish()
    }

    fn finish(&mut self) -> std::io::Result<()> {
        drop(self.requests.take());
        match self.thread.take() {
            Some(thread) => thread
                .join()
                .unwrap_or_else(|_| Err(std::io::Error::other("the writing thread panicked"))),
            None => Ok(()),
        }
    }
}

impl Drop for EventWriter {
    fn drop(&mut self) {
        let _ = self.finish();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The records of an event file: (data) after checking both CRCs.
    fn records(bytes: &[u8]) -> Vec<Vec<u8>> {
        let mut out = Vec::new();
        let mut at = 0;
        while at < bytes.len() {
            let length: [u8; 8] = bytes[at..at + 8].try_into().unwrap();
            let crc = u32::from_le_bytes(bytes[at + 8..at + 12].try_into().unwrap());
            assert_eq!(crc, masked_crc(&length));
            let n = u64::from_le_bytes(length) as usize;
            let data = &bytes[at + 12..at + 12 + n];
            let crc = u32::from_le_bytes(bytes[at + 12 + n..at + 16 + n].try_into().unwrap());
            assert_eq!(crc, masked_crc(data));
            out.push(data.to_vec());
            at += 16 + n;
        }
        out
    }

    #[test]
    fn a_new_file_sorts_after_the_event_files_already_there() {
        let dir = std::env::temp_dir().join(format!("hybridgen-tb-order-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        // A predecessor whose name is a minute ahead of this clock, and a
        // file that is not an event file.
        let ahead = now() as u64 + 60;
        let earlier = format!("events.out.tfevents.{ahead}.other-host.99999999");
        std::fs::write(dir.join(&earlier), b"").unwrap();
        std::fs::write(dir.join("events.out.tfevents.notanumber"), b"").unwrap();
        let writer = EventWriter::create(&dir).unwrap();
        let name = writer
            .path()
            .file_name()
            .unwrap()
            .to_str()
            .unwrap()
            .to_string();
        writer.close().unwrap();
        assert!(name > earlier, "{name} sorts before {earlier}");
        assert!(
            name.starts_with(&format!("events.out.tfevents.{}.", ahead + 1)),
            "{name}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn the_mask_is_tensorflows() {
        // crc32c("hello") is 0x9a71bb4c; TensorFlow's crc32c::Mask of it,
        // ((crc >> 15) | (crc << 17)) + 0xa282ead8, is 0x191c1fbb.
        assert_eq!(crc32c(b"hello"), 0x9a71_bb4c);
        assert_eq!(masked_crc(b"hello"), 0x191c_1fbb);
    }

    #[test]
    fn events_read_back_in_order_with_their_values() {
        let dir = std::env::temp_dir().join(format!("hybridgen-tb-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let writer = EventWriter::create(&dir).unwrap();
        writer.scalars(1, &[("lm loss", 5.5), ("learning-rate", 3e-3)]);
        writer.text(1, "settings", "pattern `M[*E]`");
        writer.scalars(2, &[("lm loss", 5.25)]);
        let path = writer.path().to_path_buf();
        writer.close().unwrap();
        assert!(
            path.file_name()
                .unwrap()
                .to_str()
                .unwrap()
                .contains("tfevents")
        );
        let events: Vec<Event> = records(&std::fs::read(&path).unwrap())
            .iter()
            .map(|r| Event::decode(r.as_slice()).unwrap())
            .collect();
        assert_eq!(events.len(), 4);
        assert_eq!(
            events[0].what,
            Some(What::FileVersion("brain.Event:2".into()))
        );
        let scalars = |e: &Event| -> Vec<(String, f32)> {
            match &e.what {
                Some(What::Summary(s)) => s
                    .value
                    .iter()
                    .filter_map(|v| match v.value {
                        Some(Value::SimpleValue(x)) => Some((v.tag.clone(), x)),
                        _ => None,
                    })
                    .collect(),
                _ => Vec::new(),
            }
        };
        assert_eq!(events[1].step, 1);
        assert_eq!(
            scalars(&events[1]),
            vec![("lm loss".into(), 5.5), ("learning-rate".into(), 3e-3)]
        );
        assert_eq!(events[3].step, 2);
        assert_eq!(scalars(&events[3]), vec![("lm loss".into(), 5.25)]);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn an_unwritable_directory_fails_at_creation() {
        let file = std::env::temp_dir().join(format!("hybridgen-tb-file-{}", std::process::id()));
        std::fs::write(&file, b"not a directory").unwrap();
        assert!(EventWriter::create(&file).is_err());
        let _ = std::fs::remove_file(&file);
    }
}
