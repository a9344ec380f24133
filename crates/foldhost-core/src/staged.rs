//! [`StagedFile`]: how an artifact's payload files are written, by an import into its stage and by
//! the append log's export into its copy.
//!
//! Why not `write(2)` through the page cache: on the machines this was measured on, an import's
//! time went to the kernel copying every byte into newly allocated page-cache pages (73 % of an
//! export + import's samples in `copy_folio_from_iter_atomic`), and a buffered writer that came
//! after another large write was throttled while the earlier dirty pages were written back: the
//! same 280 MB copy took 0.9 s buffered and 0.2 s with `O_DIRECT` in one run. An import writes each
//! byte once and reads none of them back, so it writes whole aligned blocks past the page cache. The
//! append log's export is the same shape: it hashes and checks its log as it encodes it, and never
//! reads the copy back.
//!
//! Invariants:
//! - **The bytes on disk are the bytes given, in order**, whatever the chunking of
//!   [`StagedFile::spare`] / [`StagedFile::commit`] (tested against buffered writes for sizes
//!   around every boundary).
//! - **Direct writes are whole 4 KiB-aligned blocks** from a 4 KiB-aligned buffer at 4 KiB-aligned
//!   offsets (every block but the last is [`BLOCK`] bytes); the tail under 4 KiB is written
//!   through the page cache by a second handle opened for append.
//! - **Where direct I/O is refused** (a filesystem without it answers `EINVAL` at open or at the
//!   first write), the file is written through the page cache instead: the
//!   same bytes, only slower.
//! - **Reading overlaps writing**: full blocks go to the file's writer thread through a bounded
//!   queue ([`BLOCKS`] blocks per file, 3 MiB), so the next block is read and hashed while the
//!   last is written. The thread stops at its first error, and that error (not a stand-in) is what
//!   the next [`StagedFile::commit`] or [`StagedFile::finish`] answers.
//! - **Durable after [`StagedFile::finish`] with `sync`**: it fsyncs the file (data and length), as
//!   the buffered path did. Without `sync` the caller fsyncs later (an export's seal does, off the
//!   fold's pause); the direct blocks are on the device already, so that is mostly the tail.
//!   [`StagedFile::finish_syncing_in`] hands the fsync to a [`Syncs`], durable once its
//!   [`Syncs::wait`] answers `Ok` (an import waits before it renames its stage into place).

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::mpsc;

/// Bytes gathered before one write: whole 4 KiB blocks.
pub(crate) const BLOCK: usize = 1 << 20;
/// Alignment of direct I/O buffers, lengths and offsets.
const ALIGN: usize = 4096;
/// Blocks per file: one being filled, the others queued for or under the writer.
const BLOCKS: usize = 3;

/// A 4 KiB-aligned block of [`BLOCK`] bytes: `buf[off..off + BLOCK]`.
struct Block {
    buf: Vec<u8>,
    off: usize,
}

impl Block {
    fn new() -> Self {
        let buf = vec![0u8; BLOCK + ALIGN];
        let off = buf.as_ptr().align_offset(ALIGN);
        // `align_offset` may answer "cannot" (usize::MAX) in theory; a misaligned block only
        // makes the kernel refuse the direct write, which falls back (see `Sink::write`).
        let off = if off < ALIGN { off } else { 0 };
        Block { buf, off }
    }

    fn bytes(&self, len: usize) -> &[u8] {
        &self.buf[self.off..self.off + len]
    }
}

/// The file itself, owned by the writer thread until [`StagedFile::finish`] takes it back.
struct Sink {
    path: PathBuf,
    file: File,
    direct: bool,
    /// Bytes written to the file.
    written: u64,
}

impl Sink {
    /// Appends `block`; a direct write the kernel refuses (`EINVAL`) switches the file to
    /// buffered writes and is written again.
    fn write(&mut self, block: &[u8]) -> std::io::Result<()> {
        match self.file.write_all(block) {
            Ok(()) => {}
            Err(e) if self.direct && e.raw_os_error() == Some(libc::EINVAL) => {
                let mut f = std::fs::OpenOptions::new().write(true).open(&self.path)?;
                // A refused write may have written part of the block: cut back to what was.
                f.set_len(self.written)?;
                use std::io::Seek;
                f.seek(std::io::SeekFrom::Start(self.written))?;
                f.write_all(block)?;
                self.file = f;
                self.direct = false;
            }
            Err(e) => return Err(e),
        }
        self.written += block.len() as u64;
        Ok(())
    }
}

/// The writer thread of one file: full blocks in, emptied blocks back.
struct Writer {
    full: mpsc::SyncSender<Block>,
    empty: mpsc::Receiver<Block>,
    /// Taken when joined (at `finish`, or at the first failure seen).
    handle: Option<std::thread::JoinHandle<std::io::Result<Sink>>>,
}

impl Writer {
    /// Joins the thread: its sink, or the error it stopped on.
    fn join(&mut self, path: &Path) -> std::io::Result<Sink> {
        match self.handle.take() {
            Some(h) => h.join().map_err(|_| {
                std::io::Error::other(format!("{}: the writer thread panicked", path.display()))
            })?,
            None => Err(std::io::Error::other(format!(
                "{}: the writer already failed",
                path.display()
            ))),
        }
    }
}

/// What [`StagedFile::finish`] wrote.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Written {
    /// Bytes in the file.
    pub bytes: u64,
    /// Whether its blocks went past the page cache to the end.
    pub direct: bool,
}

/// One payload file being written into the stage. See the module docs.
pub struct StagedFile {
    path: PathBuf,
    /// The block being filled.
    block: Block,
    /// Bytes of it filled.
    filled: usize,
    writer: Writer,
}

impl StagedFile {
    /// Creates (truncating) `path`, direct where the filesystem allows it and `direct` is asked,
    /// and starts its writer thread: reading and hashing the next block overlap writing this one.
    pub fn create(path: &Path, direct: bool) -> std::io::Result<Self> {
        let (file, direct) = match direct.then(|| open_direct(path)).flatten() {
            Some(f) => (f, true),
            None => (File::create(path)?, false),
        };
        let mut sink = Sink {
            path: path.to_path_buf(),
            file,
            direct,
            written: 0,
        };
        let (full, full_rx) = mpsc::sync_channel::<Block>(BLOCKS);
        let (empty_tx, empty) = mpsc::channel::<Block>();
        for _ in 1..BLOCKS {
            // Cannot fail: the receiver is `empty`, held here.
            let _ = empty_tx.send(Block::new());
        }
        let handle = std::thread::Builder::new()
            .name("foldhost-staged-write".into())
            .spawn(move || {
                for block in full_rx {
                    sink.write(block.bytes(BLOCK))?;
                    // The filler may have finished already: nothing to hand back to then.
                    let _ = empty_tx.send(block);
                }
                Ok(sink)
            })?;
        Ok(StagedFile {
            path: path.to_path_buf(),
            block: Block::new(),
            filled: 0,
            writer: Writer {
                full,
                empty,
                handle: Some(handle),
            },
        })
    }

    /// Moves the block being filled one byte off its alignment (tests: its direct write is then
    /// refused).
    #[cfg(test)]
    fn misalign(&mut self) {
        self.block.off += 1;
    }

    /// The free part of the current block: read into it, then [`Self::commit`] what was read.
    pub fn spare(&mut self) -> &mut [u8] {
        let start = self.block.off + self.filled;
        let end = self.block.off + BLOCK;
        &mut self.block.buf[start..end]
    }

    /// Takes `n` bytes read into [`Self::spare`]; hands the block to the writer when it is full.
    pub fn commit(&mut self, n: usize) -> std::io::Result<()> {
        debug_assert!(self.filled + n <= BLOCK, "committed past the block");
        self.filled = (self.filled + n).min(BLOCK);
        if self.filled < BLOCK {
            return Ok(());
        }
        // The writer hands back an emptied block unless it has stopped, which it only does on an
        // error: joined, that error is the answer.
        let Ok(next) = self.writer.empty.recv() else {
            return Err(self.stopped_writer());
        };
        let full = std::mem::replace(&mut self.block, next);
        self.filled = 0;
        if self.writer.full.send(full).is_err() {
            return Err(self.stopped_writer());
        }
        Ok(())
    }

    /// Appends `bytes` (copied into the blocks; for a producer that encodes rather than reads).
    pub(crate) fn write_all(&mut self, mut bytes: &[u8]) -> std::io::Result<()> {
        while !bytes.is_empty() {
            let spare = self.spare();
            let n = spare.len().min(bytes.len());
            spare[..n].copy_from_slice(&bytes[..n]);
            self.commit(n)?;
            bytes = &bytes[n..];
        }
        Ok(())
    }

    /// The error the writer thread stopped on.
    fn stopped_writer(&mut self) -> std::io::Error {
        match self.writer.join(&self.path) {
            Err(e) => e,
            Ok(_) => std::io::Error::other(format!(
                "{}: the writer stopped without an error",
                self.path.display()
            )),
        }
    }

    /// Waits for the writer, writes what is left and, with `sync`, fsyncs the file.
    pub(crate) fn finish(self, sync: bool) -> std::io::Result<Written> {
        let (written, file) = self.finish_unsynced()?;
        if sync {
            file.sync_all()?;
        }
        Ok(written)
    }

    /// Waits for the writer and writes what is left, then hands the file's fsync to `syncs`, to
    /// run beside whatever the caller writes next: [`Syncs::wait`] answers for it.
    pub fn finish_syncing_in(self, syncs: &mut Syncs) -> std::io::Result<Written> {
        let path = self.path.clone();
        let (written, file) = self.finish_unsynced()?;
        syncs.push(path, file)?;
        Ok(written)
    }

    /// Waits for the writer and writes what is left; the file is not fsynced. Answers the file
    /// (an fsync of any handle syncs the whole file, the tail written by the second handle too).
    fn finish_unsynced(self) -> std::io::Result<(Written, File)> {
        let StagedFile {
            path,
            block,
            filled,
            mut writer,
        } = self;
        // Closing the queue ends the thread once it has written every queued block.
        drop(std::mem::replace(&mut writer.full, mpsc::sync_channel(0).0));
        let mut sink = writer.join(&path)?;
        let aligned = filled / ALIGN * ALIGN;
        let whole = if sink.direct { aligned } else { filled };
        if whole > 0 {
            sink.write(block.bytes(whole))?;
        }
        let tail = filled - whole;
        if tail > 0 {
            // Under 4 KiB: through the page cache, by a handle without O_DIRECT.
            let start = block.off + whole;
            let mut f = std::fs::OpenOptions::new().append(true).open(&path)?;
            f.write_all(&block.buf[start..start + tail])?;
            sink.written += tail as u64;
        }
        Ok((
            Written {
                bytes: sink.written,
                direct: sink.direct,
            },
            sink.file,
        ))
    }
}

/// Most fsyncs [`Syncs`] runs at once; one more waits for the oldest.
pub(crate) const SYNCS_IN_FLIGHT: usize = 8;

/// The fsyncs of an import's (or an export's) finished files, each on a thread of its own, running
/// while the next files are read, hashed and written. An import of an artifact of many files spent about 1.5 ms
/// per file waiting on its fsync before it read the next one (13 files: ~20 ms of a 130 ms
/// bootstrap, the download stalled meanwhile); concurrent fsyncs also share the filesystem's
/// journal commits. At most [`SYNCS_IN_FLIGHT`] run at once.
///
/// Nothing is durable until [`Syncs::wait`] has answered `Ok`: a caller renames or publishes
/// only after it.
#[derive(Default)]
pub struct Syncs {
    running: std::collections::VecDeque<(PathBuf, std::thread::JoinHandle<std::io::Result<()>>)>,
}

impl Syncs {
    /// Starts `file`'s fsync; first waits for the oldest when [`SYNCS_IN_FLIGHT`] are running.
    pub fn push(&mut self, path: PathBuf, file: File) -> std::io::Result<()> {
        if self.running.len() >= SYNCS_IN_FLIGHT
            && let Some(oldest) = self.running.pop_front()
        {
            join_sync(oldest)?;
        }
        let handle = std::thread::Builder::new()
            .name("foldhost-staged-sync".into())
            .spawn(move || file.sync_all())?;
        self.running.push_back((path, handle));
        Ok(())
    }

    /// Waits for every fsync started; the first failure, naming its file. Every thread is joined
    /// either way.
    pub fn wait(mut self) -> std::io::Result<()> {
        let mut first = None;
        while let Some(running) = self.running.pop_front() {
            if let Err(e) = join_sync(running) {
                first.get_or_insert(e);
            }
        }
        first.map_or(Ok(()), Err)
    }
}

impl Drop for Syncs {
    /// An import that failed part-way still joins its fsync threads: none outlives it.
    fn drop(&mut self) {
        while let Some(running) = self.running.pop_front() {
            let _ = join_sync(running);
        }
    }
}

fn join_sync(
    (path, handle): (PathBuf, std::thread::JoinHandle<std::io::Result<()>>),
) -> std::io::Result<()> {
    let named = |e: std::io::Error| {
        std::io::Error::new(e.kind(), format!("{}: fsync: {e}", path.display()))
    };
    match handle.join() {
        Ok(r) => r.map_err(named),
        Err(_) => Err(named(std::io::Error::other("the fsync thread panicked"))),
    }
}

#[cfg(target_os = "linux")]
fn open_direct(path: &Path) -> Option<File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .ok()
}

#[cfg(not(target_os = "linux"))]
fn open_direct(_path: &Path) -> Option<File> {
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pattern(n: usize) -> Vec<u8> {
        (0..n).map(|i| (i * 31 + i / 4099) as u8).collect()
    }

    /// Writes `data` through a [`StagedFile`] in chunks of the sizes cycled from `chunks`.
    fn stage(path: &Path, data: &[u8], chunks: &[usize], direct: bool) -> bool {
        let mut s = StagedFile::create(path, direct).expect("create");
        let mut rest = data;
        let mut i = 0;
        while !rest.is_empty() {
            let want = chunks[i % chunks.len()].max(1);
            i += 1;
            let spare = s.spare();
            let n = want.min(spare.len()).min(rest.len());
            spare[..n].copy_from_slice(&rest[..n]);
            s.commit(n).expect("commit");
            rest = &rest[n..];
        }
        let w = s.finish(true).expect("finish");
        assert_eq!(w.bytes, data.len() as u64);
        w.direct
    }

    #[test]
    fn the_file_holds_exactly_the_bytes_given_around_every_block_boundary() {
        let dir = tempfile::tempdir().expect("tempdir");
        let sizes = [
            0,
            1,
            ALIGN - 1,
            ALIGN,
            ALIGN + 1,
            BLOCK - 1,
            BLOCK,
            BLOCK + 1,
            BLOCK + ALIGN,
            3 * BLOCK + 777,
        ];
        for direct in [true, false] {
            for (k, &n) in sizes.iter().enumerate() {
                let data = pattern(n);
                for (c, chunks) in [&[BLOCK][..], &[1000, 7, 65_536], &[ALIGN]]
                    .iter()
                    .enumerate()
                {
                    let path = dir.path().join(format!("{direct}-{k}-{c}"));
                    stage(&path, &data, chunks, direct);
                    let got = std::fs::read(&path).expect("read back");
                    assert!(
                        got == data,
                        "size {n}, chunks {chunks:?}, direct {direct}: the bytes differ"
                    );
                }
            }
        }
    }

    #[test]
    fn a_direct_write_the_kernel_refuses_is_written_again_through_the_page_cache() {
        let dir = tempfile::tempdir().expect("tempdir");
        let data = pattern(2 * BLOCK + 4097);
        // Direct where the filesystem allows it (the test is only meaningful there).
        let direct = stage(&dir.path().join("probe"), &data, &[BLOCK], true);
        let path = dir.path().join("f");
        let mut s = StagedFile::create(&path, true).expect("create");
        // A block one byte off its alignment: the kernel answers EINVAL to its direct write.
        s.misalign();
        let mut rest = &data[..];
        while !rest.is_empty() {
            let spare = s.spare();
            let n = spare.len().min(rest.len());
            spare[..n].copy_from_slice(&rest[..n]);
            s.commit(n).expect("commit");
            rest = &rest[n..];
        }
        let w = s.finish(true).expect("finish");
        assert_eq!(w.bytes, data.len() as u64);
        if direct {
            assert!(!w.direct, "refused once, buffered from then on");
        }
        assert!(std::fs::read(&path).expect("read") == data);
    }

    #[test]
    fn files_finished_into_syncs_hold_their_bytes_and_wait_answers_for_every_fsync() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut syncs = Syncs::default();
        // More files than run at once: the oldest fsyncs are joined on the way.
        let n = SYNCS_IN_FLIGHT * 2 + 3;
        for k in 0..n {
            let data = pattern(k * 5_000 + 1);
            let path = dir.path().join(format!("f{k}"));
            let mut s = StagedFile::create(&path, true).expect("create");
            s.write_all(&data).expect("write");
            let w = s.finish_syncing_in(&mut syncs).expect("finish");
            assert_eq!(w.bytes, data.len() as u64);
            assert!(syncs.running.len() <= SYNCS_IN_FLIGHT, "bounded");
        }
        syncs.wait().expect("every fsync");
        for k in 0..n {
            let got = std::fs::read(dir.path().join(format!("f{k}"))).expect("read");
            assert!(got == pattern(k * 5_000 + 1), "file {k}: the bytes differ");
        }
    }

    #[test]
    fn a_failed_background_fsync_is_answered_by_wait_naming_its_file() {
        // Linux answers an fsync of /dev/null with EINVAL: a deterministic failing fsync.
        if !cfg!(target_os = "linux") {
            return;
        }
        let dir = tempfile::tempdir().expect("tempdir");
        let mut syncs = Syncs::default();
        let ok = dir.path().join("ok");
        let mut s = StagedFile::create(&ok, true).expect("create");
        s.write_all(b"fine").expect("write");
        s.finish_syncing_in(&mut syncs).expect("finish");
        let s = StagedFile::create(Path::new("/dev/null"), false).expect("open /dev/null");
        s.finish_syncing_in(&mut syncs)
            .expect("finish: the fsync runs later");
        let err = syncs.wait().expect_err("the fsync of /dev/null fails");
        assert_eq!(err.kind(), std::io::ErrorKind::InvalidInput, "{err}");
        assert!(
            err.to_string().contains("/dev/null"),
            "names the file: {err}"
        );
    }

    #[test]
    fn a_failed_write_is_answered_with_its_own_error_not_lost_in_the_writer_thread() {
        // /dev/full answers every write with ENOSPC.
        if !Path::new("/dev/full").exists() {
            return;
        }
        let mut s = StagedFile::create(Path::new("/dev/full"), false).expect("open /dev/full");
        let mut err = None;
        for _ in 0..(BLOCKS + 2) {
            let n = s.spare().len();
            if let Err(e) = s.commit(n) {
                err = Some(e);
                break;
            }
        }
        let err = match err {
            Some(e) => e,
            None => s.finish(true).expect_err("nothing could be written"),
        };
        assert_eq!(err.raw_os_error(), Some(libc::ENOSPC), "{err}");
    }
}
