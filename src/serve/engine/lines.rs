//! The input file's lines in the order the batch enqueues them
//! (`serve::order`): the file's own order, or a plan computed from the
//! file alone and followed by seeking to each line. Either way a line's
//! position in that order is what the intake's progress counts, so an
//! intake resumed after a crash skips exactly the lines already enqueued.

use std::io::SeekFrom;

use serde_json::Value;
use tokio::io::{AsyncSeekExt, BufReader};

use crate::serve::files::{Line, read_line, read_line_len};
use crate::serve::model::BatchRecord;
use crate::serve::order::{Key, Order, plan};

use super::{BOM, Engine};

/// Where a planned line is in the file.
#[derive(Debug, Clone, Copy)]
pub(super) struct At {
    /// Byte offset of its start.
    offset: u64,
    /// Its 1-based line number (for error messages and the byte-order
    /// mark of line 1).
    number: u64,
}

/// A batch's input lines in its order, after the first `done` of them.
#[derive(Debug)]
pub(super) enum InputLines {
    /// The file's order: position = line number (blank lines count).
    Arrival {
        reader: BufReader<tokio::fs::File>,
        /// The last line number read.
        number: u64,
        max_line: u64,
    },
    /// The planned order: position = index in `lines` (blank lines are
    /// not in it).
    Planned {
        reader: BufReader<tokio::fs::File>,
        lines: Vec<At>,
        /// The next index of `lines` to read.
        next: usize,
        /// Where `reader` stands, to skip the seek between lines that
        /// follow each other in the file.
        pos: u64,
        max_line: u64,
    },
}

impl InputLines {
    /// The next line and its line number; `None` at the end.
    pub(super) async fn next(&mut self) -> std::io::Result<Option<(u64, Line)>> {
        match self {
            Self::Arrival {
                reader,
                number,
                max_line,
            } => {
                let line = read_line(reader, *max_line).await?;
                *number += 1;
                Ok(line.map(|line| (*number, line)))
            }
            Self::Planned {
                reader,
                lines,
                next,
                pos,
                max_line,
            } => {
                let Some(at) = lines.get(*next).copied() else {
                    return Ok(None);
                };
                *next += 1;
                if *pos != at.offset {
                    reader.seek(SeekFrom::Start(at.offset)).await?;
                }
                let Some((line, len)) = read_line_len(reader, *max_line).await? else {
                    return Ok(None);
                };
                *pos = at.offset + len;
                Ok(Some((at.number, line)))
            }
        }
    }
}

impl Engine {
    /// The lines of `batch`'s input in its order, the first `done`
    /// positions skipped. The planned order reads the file once more to
    /// key every line (the model name and 8 bytes per 64 characters of
    /// prompt, `order::KEY_MAX_BLOCKS`), sorts the keys and keeps 16 bytes
    /// per line.
    pub(super) async fn input_lines(
        &self,
        batch: &BatchRecord,
        done: u64,
    ) -> std::io::Result<InputLines> {
        let max_line = self.limits.max_line_bytes;
        let mut reader = self.open_input(batch).await?;
        if batch.order == Order::Arrival {
            for _ in 0..done {
                if read_line(&mut reader, max_line).await?.is_none() {
                    break;
                }
            }
            return Ok(InputLines::Arrival {
                reader,
                number: done,
                max_line,
            });
        }
        let (mut at, mut keys) = (Vec::new(), Vec::new());
        let (mut offset, mut number) = (0u64, 0u64);
        while let Some((line, len)) = read_line_len(&mut reader, max_line).await? {
            number += 1;
            if let Some(key) = line_key(number, &line) {
                at.push(At { offset, number });
                keys.push(key);
            }
            offset += len;
        }
        let order = plan(&keys);
        drop(keys);
        let lines: Vec<At> = order.into_iter().map(|i| at[i as usize]).collect();
        let next = usize::try_from(done).unwrap_or(usize::MAX).min(lines.len());
        Ok(InputLines::Planned {
            reader,
            lines,
            next,
            pos: offset,
            max_line,
        })
    }
}

/// The sort key of input line `number`; `None` for a blank line, which
/// the order leaves out. A line that is not a JSON object with a `body`
/// (validation refused such files, so none should come) sorts with an
/// empty key, and the intake skips it as it would in file order.
fn line_key(number: u64, line: &Line) -> Option<Key> {
    let Line::Text(bytes) = line else {
        return Some(Key::default());
    };
    let bytes: &[u8] = bytes;
    let bytes = match number {
        1 => bytes.strip_prefix(BOM).unwrap_or(bytes),
        _ => bytes,
    };
    // Blank as `check_line` sees it.
    if std::str::from_utf8(bytes).is_ok_and(|t| t.trim().is_empty()) {
        return None;
    }
    let body = serde_json::from_slice::<Value>(bytes)
        .ok()
        .and_then(|mut v| v.get_mut("body").map(Value::take));
    Some(body.map(|b| Key::of(&b)).unwrap_or_default())
}

#[cfg(test)]
mod tests {
    use super::super::tests::{engine, record};
    use super::*;
    use crate::serve::model::BatchStatus;

    /// A file of `groups` prompts sharing long prefixes, interleaved, with
    /// a byte-order mark, a blank line and a CRLF line among them.
    fn file() -> String {
        let mut text = String::from("\u{feff}");
        for i in 0..23 {
            if i == 5 {
                text.push('\n');
            }
            let prefix: String = std::iter::repeat_n(['a', 'b', 'c'][i % 3], 200).collect();
            let model = ["m2", "m1"][i % 2];
            let end = if i == 9 { "\r\n" } else { "\n" };
            text.push_str(&format!(
                "{{\"custom_id\":\"r{i}\",\"method\":\"POST\",\"url\":\"/v1/completions\",\"body\":{{\"model\":\"{model}\",\"prompt\":\"{prefix}{i}\"}}}}{end}"
            ));
        }
        text
    }

    async fn read_all(engine: &Engine, batch: &BatchRecord, done: u64) -> Vec<(u64, Line)> {
        let mut lines = engine.input_lines(batch, done).await.expect("opens");
        let mut out = Vec::new();
        while let Some(line) = lines.next().await.expect("reads") {
            out.push(line);
        }
        out
    }

    #[tokio::test]
    async fn a_resumed_read_continues_exactly_where_the_count_stopped() {
        let dir =
            std::env::temp_dir().join(format!("sluicegate-lines-{:x}", rand::random::<u64>()));
        std::fs::create_dir_all(&dir).expect("dir");
        let engine = engine(&dir);
        std::fs::write(engine.bodies.path("file-x"), file()).expect("input");
        let mut batch = record(BatchStatus::InProgress);
        for order in [Order::Arrival, Order::ModelPrefix] {
            batch.order = order;
            let all = read_all(&engine, &batch, 0).await;
            for done in 0..=all.len() {
                let rest = read_all(&engine, &batch, done as u64).await;
                assert_eq!(rest, all[done..], "{order:?} resumed after {done}");
            }
            let numbers: Vec<u64> = all.iter().map(|(n, _)| *n).collect();
            match order {
                Order::Arrival => assert_eq!(numbers, (1..=24).collect::<Vec<u64>>()),
                Order::ModelPrefix => {
                    let mut sorted = numbers.clone();
                    sorted.sort_unstable();
                    let non_blank: Vec<u64> = (1..=24).filter(|n| *n != 6).collect();
                    assert_eq!(sorted, non_blank, "every line but the blank one, once");
                    assert_ne!(numbers, non_blank, "a different order than the file's");
                    // Grouped: the model and prefix change at most 5 times.
                    let group = |(_, line): &(u64, Line)| match line {
                        Line::Text(t) => {
                            let t = String::from_utf8_lossy(t).into_owned();
                            let model = if t.contains("\"m1\"") { "m1" } else { "m2" };
                            let prefix = t.split("\"prompt\":\"").nth(1).map(|p| p.chars().next());
                            (model, prefix)
                        }
                        Line::TooLong => ("", None),
                    };
                    let changes = all
                        .windows(2)
                        .filter(|w| group(&w[0]) != group(&w[1]))
                        .count();
                    assert_eq!(changes, 5, "{numbers:?}");
                }
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
