//! The tar form of an artifact: packing (manifest first), unpacking, and [`TarGuard`], which refuses what the tar crate would buffer whole before it reads it.

use super::*;

/// Packs the artifact directory `artifact` into the tar file `out` (written beside, then renamed).
pub(crate) fn pack_tar(artifact: &Path, out: &Path) -> Result<(), ArtifactError> {
    pack_tar_with(artifact, out, None)
}

/// [`pack_tar`] with `manifest` (checked, and naming the same files) as the tar's manifest
/// instead of the artifact's own: a publish adds the pointer's previous targets.
pub(crate) fn pack_tar_with(
    artifact: &Path,
    out: &Path,
    manifest: Option<&[u8]>,
) -> Result<(), ArtifactError> {
    let m = read_manifest(artifact)?;
    if let Some(bytes) = manifest {
        let given = parse_manifest(bytes, &artifact.join(MANIFEST_FILE))?;
        if given.files != m.files {
            return Err(ArtifactError::Manifest {
                path: artifact.join(MANIFEST_FILE),
                reason: "the manifest to publish lists other files than the artifact's".into(),
            });
        }
    }
    let tmp = stage_path(out, "tar");
    let r = (|| {
        let file = File::create(&tmp).map_err(io_err(&tmp, "create"))?;
        let mut b = tar::Builder::new(std::io::BufWriter::new(file));
        let tar_err = |e: std::io::Error| ArtifactError::Io {
            path: out.to_path_buf(),
            op: "write tar",
            source: e,
        };
        match manifest {
            None => b
                .append_path_with_name(artifact.join(MANIFEST_FILE), MANIFEST_FILE)
                .map_err(tar_err)?,
            Some(bytes) => {
                let mut h = tar::Header::new_gnu();
                h.set_size(bytes.len() as u64);
                h.set_mode(0o644);
                h.set_mtime(0);
                h.set_entry_type(tar::EntryType::Regular);
                b.append_data(&mut h, MANIFEST_FILE, bytes)
                    .map_err(tar_err)?;
            }
        }
        for f in &m.files {
            let rel = check_path(&f.path)?;
            b.append_path_with_name(
                artifact.join(DATA_DIR).join(&rel),
                Path::new(DATA_DIR).join(&rel),
            )
            .map_err(tar_err)?;
        }
        let w = b.into_inner().map_err(tar_err)?;
        let file = w.into_inner().map_err(|e| tar_err(e.into_error()))?;
        file.sync_all().map_err(io_err(&tmp, "fsync"))?;
        std::fs::rename(&tmp, out).map_err(io_err(out, "rename tar into place"))
    })();
    if r.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    r
}

/// Unpacks a tar into the new directory `into`, refusing unsafe paths and anything but regular
/// files and directories.
pub(super) fn unpack_tar(tar_path: &Path, into: &Path) -> Result<(), ArtifactError> {
    let bad = |reason: String| ArtifactError::Tar {
        path: tar_path.to_path_buf(),
        reason,
    };
    std::fs::create_dir_all(into).map_err(io_err(into, "create unpack dir"))?;
    let file = File::open(tar_path).map_err(io_err(tar_path, "open"))?;
    let mut archive = tar::Archive::new(TarGuard::new(std::io::BufReader::new(file)));
    let entries = archive.entries().map_err(|e| bad(e.to_string()))?;
    let mut count = 0usize;
    for entry in entries {
        let mut entry = entry.map_err(|e| bad(e.to_string()))?;
        count += 1;
        if count > MAX_FILES + 1 {
            return Err(bad(format!("more than {MAX_FILES} entries")));
        }
        let raw = entry.path_bytes().into_owned();
        let name = String::from_utf8(raw).map_err(|_| bad("an entry path is not UTF-8".into()))?;
        let name = name.trim_end_matches('/');
        let rel = check_path(name)?;
        let kind = entry.header().entry_type();
        if kind.is_dir() {
            let d = into.join(&rel);
            std::fs::create_dir_all(&d).map_err(io_err(&d, "create"))?;
            continue;
        }
        if !kind.is_file() {
            return Err(ArtifactError::EntryType {
                path: name.to_string(),
                kind: format!("{kind:?}"),
            });
        }
        let size = entry.header().size().map_err(|e| bad(e.to_string()))?;
        if size > MAX_FILE_BYTES {
            return Err(bad(format!("{name}: {size} bytes, over {MAX_FILE_BYTES}")));
        }
        let dst = into.join(&rel);
        if let Some(parent) = dst.parent() {
            std::fs::create_dir_all(parent).map_err(io_err(parent, "create"))?;
        }
        let mut out = File::create(&dst).map_err(io_err(&dst, "create"))?;
        std::io::copy(&mut (&mut entry).take(size), &mut out).map_err(io_err(&dst, "unpack"))?;
    }
    Ok(())
}

/// The tar entry types whose body the `tar` crate reads whole into memory: GNU long name and long
/// link, PAX local and global extensions.
const TAR_EXTENSIONS: [u8; 4] = [b'L', b'K', b'x', b'g'];

/// A reader in front of the `tar` crate that parses every 512-byte header as it passes and
/// refuses, before any byte of its body is read, an extension entry larger than
/// [`MAX_TAR_EXTENSION_BYTES`] (the `tar` crate would read it whole: a 1 GiB `L` entry would be a
/// 1 GiB allocation), a GNU sparse entry (its extra header blocks would move the entry
/// boundaries this reader counts; no artifact holds one) and a PAX `size` record (it would
/// override the header's length). It follows the archive entry by entry: a header, then the
/// body rounded up to 512 bytes; an all-zero header ends the archive, and what follows passes
/// unchecked (the `tar` crate reads nothing after it). Its own memory: one header block and a PAX
/// body (bounded as above).
pub(crate) struct TarGuard<R> {
    inner: R,
    /// Offset in the archive of the next byte read.
    offset: u64,
    header: [u8; 512],
    /// Bytes of `header` collected.
    filled: usize,
    /// Body (and padding) bytes left before the next header.
    body_left: u64,
    /// A PAX body being collected, and how many of its bytes are still to come.
    pax: Option<(Vec<u8>, u64)>,
    ended: bool,
    /// The refusal, repeated to every later read.
    refused: Option<String>,
}

impl<R> TarGuard<R> {
    /// Guards `inner`.
    pub fn new(inner: R) -> Self {
        TarGuard {
            inner,
            offset: 0,
            header: [0; 512],
            filled: 0,
            body_left: 0,
            pax: None,
            ended: false,
            refused: None,
        }
    }

    /// A tar header's size field as the `tar` crate reads it (octal text up to a NUL, spaces
    /// trimmed; or, with the high bit set, binary in its last 8 bytes); `None` when it is neither.
    fn size_field(field: &[u8]) -> Option<u64> {
        if field.first()? & 0x80 != 0 {
            let tail = field.get(field.len().checked_sub(8)?..)?;
            return Some(u64::from_be_bytes(tail.try_into().ok()?));
        }
        let end = field.iter().position(|&b| b == 0).unwrap_or(field.len());
        let text = std::str::from_utf8(&field[..end]).ok()?;
        u64::from_str_radix(text.trim(), 8).ok()
    }

    /// Checks the header just collected (which started at `at`) and sets up its body.
    fn header_done(&mut self, at: u64) -> Result<(), String> {
        if self.header.iter().all(|&b| b == 0) {
            self.ended = true;
            return Ok(());
        }
        let kind = self.header[156];
        let size = Self::size_field(&self.header[124..136])
            .ok_or_else(|| format!("tar header at byte {at}: an unreadable size field"))?;
        if kind == b'S' {
            return Err(format!(
                "tar header at byte {at}: a GNU sparse entry (never part of an artifact)"
            ));
        }
        if TAR_EXTENSIONS.contains(&kind) && size > MAX_TAR_EXTENSION_BYTES {
            return Err(format!(
                "tar header at byte {at}: a {} extension entry of {size} bytes, over the limit of {MAX_TAR_EXTENSION_BYTES}",
                match kind {
                    b'L' => "GNU long-name (L)",
                    b'K' => "GNU long-link (K)",
                    b'x' => "PAX (x)",
                    _ => "PAX global (g)",
                }
            ));
        }
        if kind == b'x' && size > 0 {
            self.pax = Some((Vec::with_capacity(size as usize), size));
        }
        self.body_left = size
            .checked_add(511)
            .map(|s| s & !511)
            .ok_or_else(|| format!("tar header at byte {at}: size {size} overflows"))?;
        Ok(())
    }

    /// Follows the archive over `bytes` (just read, starting at `self.offset`).
    fn follow(&mut self, mut bytes: &[u8]) -> Result<(), String> {
        while !bytes.is_empty() && !self.ended {
            if self.body_left > 0 {
                let n = bytes
                    .len()
                    .min(usize::try_from(self.body_left).unwrap_or(usize::MAX));
                if let Some((buf, left)) = &mut self.pax {
                    let take = n.min(usize::try_from(*left).unwrap_or(usize::MAX));
                    buf.extend_from_slice(&bytes[..take]);
                    *left -= take as u64;
                    if *left == 0 {
                        let body = std::mem::take(buf);
                        self.pax = None;
                        if body.windows(6).any(|w| w == b" size=") {
                            return Err(format!(
                                "tar entry before byte {}: a PAX size record (entry lengths are read from the headers)",
                                self.offset
                            ));
                        }
                    }
                }
                self.body_left -= n as u64;
                self.offset += n as u64;
                bytes = &bytes[n..];
                continue;
            }
            let n = bytes.len().min(512 - self.filled);
            self.header[self.filled..self.filled + n].copy_from_slice(&bytes[..n]);
            self.filled += n;
            self.offset += n as u64;
            bytes = &bytes[n..];
            if self.filled == 512 {
                self.filled = 0;
                self.header_done(self.offset - 512)?;
            }
        }
        Ok(())
    }
}

impl<R: Read> Read for TarGuard<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if let Some(why) = &self.refused {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                why.clone(),
            ));
        }
        let n = self.inner.read(buf)?;
        if let Err(why) = self.follow(&buf[..n]) {
            self.refused = Some(why.clone());
            return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, why));
        }
        Ok(n)
    }
}
