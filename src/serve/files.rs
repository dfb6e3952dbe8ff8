//! File bodies on disk: `<data_dir>/files/<id>`, written to a temporary
//! name first and renamed when complete, so a crash never leaves half a
//! file under a real id. With Redis, `data_dir` is a volume every replica
//! mounts.

use std::path::{Path, PathBuf};

use tokio::io::{AsyncBufRead, AsyncBufReadExt, AsyncReadExt};

/// The body directory.
#[derive(Debug, Clone)]
pub struct Bodies {
    dir: PathBuf,
}

impl Bodies {
    /// Creates `<data_dir>/files` if needed.
    pub fn open(data_dir: &Path) -> std::io::Result<Self> {
        let dir = data_dir.join("files");
        std::fs::create_dir_all(&dir)?;
        Ok(Self { dir })
    }

    /// Where the body of `id` lives.
    pub fn path(&self, id: &str) -> PathBuf {
        self.dir.join(id)
    }

    /// A fresh temporary path in the same directory (same filesystem, so
    /// the final rename is atomic).
    pub fn temp(&self) -> PathBuf {
        self.dir
            .join(format!(".tmp-{:032x}", rand::random::<u128>()))
    }

    /// Moves a complete temporary file to the body of `id`.
    pub async fn commit(&self, temp: &Path, id: &str) -> std::io::Result<()> {
        tokio::fs::rename(temp, self.path(id)).await
    }

    /// Removes the body of `id`; a missing body is not an error.
    pub async fn remove(&self, id: &str) -> std::io::Result<()> {
        match tokio::fs::remove_file(self.path(id)).await {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        }
    }
}

/// One line of an input file, read with a bounded buffer.
#[derive(Debug, PartialEq, Eq)]
pub enum Line {
    /// The line's bytes, without its line ending.
    Text(Vec<u8>),
    /// Longer than the limit: skipped without being held in memory.
    TooLong,
}

/// Reads the next line, holding at most `max + 1` bytes of it; `None` at
/// the end of the input.
pub async fn read_line<R: AsyncBufRead + Unpin>(
    reader: &mut R,
    max: u64,
) -> std::io::Result<Option<Line>> {
    Ok(read_line_len(reader, max).await?.map(|(line, _)| line))
}

/// [`read_line`], and the bytes it consumed (line ending included): where
/// the next line starts, for a reader that comes back to a line by its
/// offset.
pub async fn read_line_len<R: AsyncBufRead + Unpin>(
    reader: &mut R,
    max: u64,
) -> std::io::Result<Option<(Line, u64)>> {
    let mut buf = Vec::new();
    let n = (&mut *reader)
        .take(max.saturating_add(1))
        .read_until(b'\n', &mut buf)
        .await?;
    if n == 0 {
        return Ok(None);
    }
    let mut consumed = n as u64;
    let ended = buf.last() == Some(&b'\n');
    if ended || buf.len() as u64 <= max {
        if ended {
            buf.pop();
        }
        if buf.last() == Some(&b'\r') {
            buf.pop();
        }
        return Ok(Some((Line::Text(buf), consumed)));
    }
    // Too long: skip the rest of the line in small pieces.
    loop {
        buf.clear();
        let n = (&mut *reader)
            .take(64 * 1024)
            .read_until(b'\n', &mut buf)
            .await?;
        consumed += n as u64;
        if n == 0 || buf.last() == Some(&b'\n') {
            return Ok(Some((Line::TooLong, consumed)));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn long_lines_are_skipped_and_the_next_line_is_read() {
        let text = b"short\r\nthis line is too long\nok\nlast-no-newline".to_vec();
        let mut reader = tokio::io::BufReader::new(&text[..]);
        let mut got = Vec::new();
        while let Some(line) = read_line(&mut reader, 15).await.expect("reads") {
            got.push(line);
        }
        assert_eq!(
            got,
            vec![
                Line::Text(b"short".to_vec()),
                Line::TooLong,
                Line::Text(b"ok".to_vec()),
                Line::Text(b"last-no-newline".to_vec()),
            ]
        );
    }

    #[tokio::test]
    async fn consumed_lengths_add_up_to_each_line_start() {
        let text = b"short\r\nthis line is too long\nok\nlast".to_vec();
        let mut reader = tokio::io::BufReader::new(&text[..]);
        let mut starts = vec![0u64];
        while let Some((_, n)) = read_line_len(&mut reader, 15).await.expect("reads") {
            starts.push(starts.last().copied().unwrap_or(0) + n);
        }
        assert_eq!(starts, vec![0, 7, 29, 32, 36]);
    }
}
