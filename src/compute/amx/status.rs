//! Whether this process runs the AMX tiles: probed once (the CPU's feature bits, then Linux's
//! grant of the tile state), and set aside by configuration or a benchmark.

use std::sync::OnceLock;

/// Whether this process runs AMX tiles, and why not where it does not.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AmxStatus {
    /// The CPU has AMX-TILE and AMX-BF16 and Linux granted the tile state.
    Enabled,
    /// Not used, for the reason given.
    Unavailable(String),
}

/// This process's AMX status, probed once: the CPU's feature bits, then the kernel's grant.
pub fn status() -> &'static AmxStatus {
    static STATUS: OnceLock<AmxStatus> = OnceLock::new();
    STATUS.get_or_init(probe)
}

/// Whether products may take the AMX tiles.
pub fn enabled() -> bool {
    *status() == AmxStatus::Enabled && !is_set_aside()
}

/// Whether [`set_aside`] turned the tiles off.
pub fn is_set_aside() -> bool {
    SET_ASIDE.load(std::sync::atomic::Ordering::Relaxed)
}

/// Set by [`set_aside`].
static SET_ASIDE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Products leave the AMX tiles alone (`true`) or take them again where granted (`false`):
/// `devices.cpu_amx`, and benchmarks that compare the kernels side by side in one process.
pub fn set_aside(aside: bool) {
    SET_ASIDE.store(aside, std::sync::atomic::Ordering::Relaxed);
}

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn probe() -> AmxStatus {
    use std::arch::x86_64::__cpuid_count;
    // Leaf 0 gives the highest leaf.
    let highest = __cpuid_count(0, 0).eax;
    if highest < 7 {
        return AmxStatus::Unavailable("the CPU has no AMX".into());
    }
    let features = __cpuid_count(7, 0).edx;
    let (tile, bf16) = (features & (1 << 24) != 0, features & (1 << 22) != 0);
    if !(tile && bf16) {
        return AmxStatus::Unavailable("the CPU has no AMX-BF16".into());
    }
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: arch_prctl with ARCH_REQ_XCOMP_PERM takes two integers and changes only which
    // register state this process may use; it fails cleanly where the kernel will not.
    let granted = unsafe {
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        )
    };
    if granted != 0 {
        let error = std::io::Error::last_os_error();
        return AmxStatus::Unavailable(format!(
            "the CPU reports AMX-BF16 but Linux refused its tile state ({error})"
        ));
    }
    AmxStatus::Enabled
}

#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
fn probe() -> AmxStatus {
    AmxStatus::Unavailable("AMX tiles are used on x86_64 Linux only".into())
}
