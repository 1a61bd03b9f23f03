//! `bgs serve --user NAME[:GROUP]`: give up root once every privileged step is done.
//!
//! The server starts as root (loading and attaching the BPF programs, the io_uring rings, a
//! port below 1024, pinned memory), and [`drop_to`] then switches every thread of the process
//! to the target user and group for good. What the kernel transport does afterwards needs no
//! privilege on the kernels it runs on (5.11+ for memcg-accounted BPF memory; 6.5+ for map
//! operations without `CAP_BPF`): map lookups, updates and deletes go through map descriptors
//! it already holds (since Linux 6.5 the `bpf()` permission checks are made where maps and
//! programs are created, not on every command), the rings and the doorbell buffer are mapped
//! already, io_uring operations go through rings already set up (an SQPOLL thread keeps the
//! credentials of the ring's creator), futexes and sockets need nothing, and the programs
//! detach at exit by closing their link and map descriptors. So no capability is kept; see
//! docs/operations.md.

use std::ffi::{CStr, CString};
use std::io;

use anyhow::{Context, Result, bail};

/// The user and group to switch to, resolved before anything starts.
#[derive(Debug, Clone)]
pub struct Target {
    /// As given (for messages).
    spec: String,
    uid: libc::uid_t,
    gid: libc::gid_t,
    /// The user's name when it has a passwd entry: its supplementary groups are taken from
    /// the group database (`initgroups`), as `su` and systemd's `User=` do.
    name: Option<CString>,
}

impl Target {
    /// The numeric user id.
    pub fn uid(&self) -> u32 {
        self.uid
    }

    /// The numeric group id.
    pub fn gid(&self) -> u32 {
        self.gid
    }
}

/// A passwd entry's uid, primary gid and name.
fn passwd(
    by: Result<&CStr, libc::uid_t>,
) -> io::Result<Option<(libc::uid_t, libc::gid_t, CString)>> {
    let mut buf = vec![0u8; 16 * 1024];
    // SAFETY: a zeroed passwd is a valid out-parameter (plain pointers and integers).
    let mut pw: libc::passwd = unsafe { std::mem::zeroed() };
    let mut out: *mut libc::passwd = std::ptr::null_mut();
    // SAFETY: every pointer is valid for the call; `buf` outlives the use of the strings
    // `pw` points into (copied below before `buf` is dropped).
    let rc = unsafe {
        match by {
            Ok(name) => libc::getpwnam_r(
                name.as_ptr(),
                &mut pw,
                buf.as_mut_ptr().cast(),
                buf.len(),
                &mut out,
            ),
            Err(uid) => {
                libc::getpwuid_r(uid, &mut pw, buf.as_mut_ptr().cast(), buf.len(), &mut out)
            }
        }
    };
    if rc != 0 {
        return Err(io::Error::from_raw_os_error(rc));
    }
    if out.is_null() {
        return Ok(None);
    }
    // SAFETY: on success pw_name points to a NUL-terminated string inside `buf`.
    let name = unsafe { CStr::from_ptr(pw.pw_name) }.to_owned();
    Ok(Some((pw.pw_uid, pw.pw_gid, name)))
}

/// A group's gid by name.
fn group_gid(name: &CStr) -> io::Result<Option<libc::gid_t>> {
    let mut buf = vec![0u8; 64 * 1024];
    // SAFETY: a zeroed group is a valid out-parameter.
    let mut gr: libc::group = unsafe { std::mem::zeroed() };
    let mut out: *mut libc::group = std::ptr::null_mut();
    // SAFETY: every pointer is valid for the call.
    let rc = unsafe {
        libc::getgrnam_r(
            name.as_ptr(),
            &mut gr,
            buf.as_mut_ptr().cast(),
            buf.len(),
            &mut out,
        )
    };
    if rc != 0 {
        return Err(io::Error::from_raw_os_error(rc));
    }
    Ok((!out.is_null()).then_some(gr.gr_gid))
}

/// Resolve `NAME[:GROUP]` (names or numeric ids). Without a group, the user's primary group.
pub fn resolve(spec: &str) -> Result<Target> {
    let (user, group) = match spec.split_once(':') {
        Some((u, g)) => (u, Some(g)),
        None => (spec, None),
    };
    if user.is_empty() || group.is_some_and(str::is_empty) {
        bail!("--user {spec:?}: expected NAME[:GROUP]");
    }
    let entry = match user.parse::<libc::uid_t>() {
        Ok(uid) => {
            passwd(Err(uid)).map(|e| e.or(Some((uid, libc::gid_t::MAX, CString::default()))))
        }
        Err(_) => {
            let c = CString::new(user)
                .with_context(|| format!("--user {spec:?}: a NUL in the name"))?;
            passwd(Ok(&c))
        }
    }
    .with_context(|| format!("--user {spec:?}: reading the user database"))?;
    let Some((uid, primary, name)) = entry else {
        bail!("--user {spec:?}: no such user");
    };
    let gid = match group {
        None if primary == libc::gid_t::MAX => {
            bail!(
                "--user {spec:?}: uid {uid} has no passwd entry, so give its group: --user {uid}:GROUP"
            )
        }
        None => primary,
        Some(g) => match g.parse::<libc::gid_t>() {
            Ok(gid) => gid,
            Err(_) => {
                let c = CString::new(g)
                    .with_context(|| format!("--user {spec:?}: a NUL in the group"))?;
                group_gid(&c)
                    .with_context(|| format!("--user {spec:?}: reading the group database"))?
                    .with_context(|| format!("--user {spec:?}: no such group {g:?}"))?
            }
        },
    };
    if uid == 0 {
        bail!("--user {spec:?} is root: that drops nothing (name an unprivileged user)");
    }
    Ok(Target {
        spec: spec.to_string(),
        uid,
        gid,
        name: (!name.is_empty()).then_some(name),
    })
}

/// Refuse `--user` unless running as root (only root can switch to another user).
pub fn check_root(t: &Target) -> Result<()> {
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    if euid != 0 {
        bail!(
            "--user {}: switching users needs root (bgs runs as uid {euid}); start it as root or leave --user out",
            t.spec
        );
    }
    Ok(())
}

fn os(step: &str) -> anyhow::Error {
    anyhow::anyhow!("{step}: {}", io::Error::last_os_error())
}

/// Switch every thread of the process to `t` for good, then prove that root cannot be
/// regained. The C library's wrappers (unlike raw system calls, which change only the calling
/// thread) apply the change to all threads of the process.
pub fn drop_to(t: &Target) -> Result<()> {
    let ctx = || format!("dropping privileges to --user {}", t.spec);
    // Supplementary groups first, then the group, then the user (the reverse order would lose
    // the right to change groups).
    // SAFETY: valid C string / one-element array for the calls.
    let rc = unsafe {
        match &t.name {
            Some(name) => libc::initgroups(name.as_ptr(), t.gid),
            None => libc::setgroups(1, &t.gid),
        }
    };
    if rc != 0 {
        return Err(os("setting the supplementary groups")).with_context(ctx);
    }
    // SAFETY: plain system call wrappers.
    if unsafe { libc::setresgid(t.gid, t.gid, t.gid) } != 0 {
        return Err(os("setresgid")).with_context(ctx);
    }
    // SAFETY: as above.
    if unsafe { libc::setresuid(t.uid, t.uid, t.uid) } != 0 {
        return Err(os("setresuid")).with_context(ctx);
    }
    verify(t).with_context(ctx)
}

/// Every thread runs as `t` with no capability, and neither uid 0 nor gid 0 can be taken back.
fn verify(t: &Target) -> Result<()> {
    let (mut r, mut e, mut s) = (0, 0, 0);
    // SAFETY: valid out-pointers.
    if unsafe { libc::getresuid(&mut r, &mut e, &mut s) } != 0 || [r, e, s] != [t.uid; 3] {
        bail!("uids are {r}/{e}/{s} after setresuid({})", t.uid);
    }
    // SAFETY: valid out-pointers.
    if unsafe { libc::getresgid(&mut r, &mut e, &mut s) } != 0 || [r, e, s] != [t.gid; 3] {
        bail!("gids are {r}/{e}/{s} after setresgid({})", t.gid);
    }
    // SAFETY: plain system call wrappers; they must fail.
    if unsafe { libc::setresuid(0, 0, 0) } == 0 || unsafe { libc::seteuid(0) } == 0 {
        bail!("root could be regained (setresuid(0) succeeded)");
    }
    // SAFETY: as above.
    if t.gid != 0 && unsafe { libc::setresgid(0, 0, 0) } == 0 {
        bail!("gid 0 could be regained (setresgid(0) succeeded)");
    }
    // Every thread (the C library changed them all, or the drop is incomplete).
    let tasks = std::fs::read_dir("/proc/self/task").context("listing /proc/self/task")?;
    for task in tasks {
        let path = task
            .context("reading /proc/self/task")?
            .path()
            .join("status");
        let Ok(status) = std::fs::read_to_string(&path) else {
            continue; // the thread exited meanwhile
        };
        check_status(&status, t.uid, t.gid).with_context(|| format!("{}", path.display()))?;
    }
    Ok(())
}

/// A `/proc/.../status` text says uid and gid (all four ids each) and no capability.
pub fn check_status(status: &str, uid: u32, gid: u32) -> Result<()> {
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .map(str::trim)
            .with_context(|| format!("no {name} line"))
    };
    for (name, want) in [("Uid:", uid), ("Gid:", gid)] {
        let ids: Vec<u32> = field(name)?
            .split_whitespace()
            .map(|v| v.parse().context("a non-numeric id"))
            .collect::<Result<_>>()?;
        if ids.len() != 4 || ids.iter().any(|&i| i != want) {
            bail!("{name} {ids:?}, want {want} four times");
        }
    }
    for name in ["CapInh:", "CapPrm:", "CapEff:", "CapAmb:"] {
        let v = u64::from_str_radix(field(name)?, 16).context("a non-hex capability set")?;
        if v != 0 {
            bail!("{name} {v:#x}: capabilities left");
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resolves_names_ids_and_groups() {
        let t = resolve("nobody").unwrap();
        assert!(t.uid() != 0);
        assert_eq!(t.name.as_deref(), Some(c"nobody"));
        let by_id = resolve(&t.uid().to_string()).unwrap();
        assert_eq!((by_id.uid(), by_id.gid()), (t.uid(), t.gid()));
        let g = resolve("nobody:12345").unwrap();
        assert_eq!((g.uid(), g.gid()), (t.uid(), 12345));
        let root_group = resolve("nobody:root").unwrap();
        assert_eq!(root_group.gid(), 0);
    }

    #[test]
    fn bad_specs_are_one_line_errors() {
        for (spec, want) in [
            ("", "expected NAME[:GROUP]"),
            ("nobody:", "expected NAME[:GROUP]"),
            ("no-such-user-bgs", "no such user"),
            ("nobody:no-such-group-bgs", "no such group"),
            ("root", "is root"),
            ("0", "is root"),
            ("4000000", "give its group"),
        ] {
            let e = format!("{:#}", resolve(spec).unwrap_err());
            assert!(e.contains(want), "{spec:?}: {e}");
            assert!(!e.contains('\n'), "{spec:?}: {e}");
        }
        let t = resolve("4000000:4000000").unwrap();
        assert_eq!(
            (t.uid(), t.gid(), t.name.is_none()),
            (4_000_000, 4_000_000, true)
        );
    }

    #[test]
    fn status_check_reads_every_id_and_capability_set() {
        let ok = "Name:\tbgs\nUid:\t65534\t65534\t65534\t65534\nGid:\t7\t7\t7\t7\n\
                  CapInh:\t0000000000000000\nCapPrm:\t0000000000000000\n\
                  CapEff:\t0000000000000000\nCapBnd:\t000001ffffffffff\nCapAmb:\t0000000000000000\n";
        check_status(ok, 65534, 7).unwrap();
        assert!(check_status(ok, 65534, 8).is_err());
        let saved_root = ok.replace(
            "Uid:\t65534\t65534\t65534\t65534",
            "Uid:\t65534\t65534\t0\t65534",
        );
        assert!(check_status(&saved_root, 65534, 7).is_err());
        let cap = ok.replace("CapPrm:\t0000000000000000", "CapPrm:\t0000000000001000");
        assert!(format!("{:#}", check_status(&cap, 65534, 7).unwrap_err()).contains("CapPrm"));
    }
}
