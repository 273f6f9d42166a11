//! `nodekeeper-controller`: parses the command line and runs the controller. Exits non-zero when
//! it loses the Lease, so that the Pod restarts as a standby.

use clap::Parser;

/// mimalloc, set to hand freed memory back to the system at once (see [`set_allocator_options`]).
/// Measured with the fleet rig at 1,000 nodes (`BENCHMARKS.md` § fleet): 31.7 MiB of RSS against
/// 49.3 with glibc's allocator and 73.2 with mimalloc's defaults. The shipped image is a static
/// musl binary, whose own allocator this replaces as well. The `system-allocator` feature leaves
/// it out, for heap profilers that hook `malloc`.
#[cfg(not(feature = "system-allocator"))]
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// `mi_option_arena_eager_commit`, `mi_option_purge_delay` and `mi_option_generic_collect` in
/// `mi_option_e` (mimalloc.h, the v3 sources libmimalloc-sys vendors);
/// `options_are_the_ones_meant` checks their defaults.
const MI_OPTION_ARENA_EAGER_COMMIT: libmimalloc_sys::mi_option_t = 4;
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;
const MI_OPTION_GENERIC_COLLECT: libmimalloc_sys::mi_option_t = 34;

/// Freed memory goes back to the system at once (purge delay 0, instead of a second of reuse) and
/// arenas are committed as they are used rather than whole, so that the controller's RSS
/// follows what it holds (a sweep's calls in flight, a list page being decoded) instead of its
/// peaks. A thread also collects its heap every 1,000 calls into mimalloc's slower allocation
/// path rather than every 10,000: the pages other threads freed for it go back only then, and
/// on a quiet controller 10,000 such calls took over two minutes after a sweep, 13 MiB held
/// meanwhile at 10,000 nodes (BENCHMARKS.md § fleet). An operator's own
/// `MIMALLOC_PURGE_DELAY` / `MIMALLOC_ARENA_EAGER_COMMIT` / `MIMALLOC_GENERIC_COLLECT` win.
///
/// The options must be in place before mimalloc makes its first arena (set from `main`, the
/// arena made for the runtime's first allocations stays eagerly committed, and the controller's
/// RSS at 10,000 nodes was no lower than with glibc): the loader runs this before any Rust code
/// allocates ([`SET_ALLOCATOR_OPTIONS`]), as it would the C constructors of a shared library.
#[cfg_attr(any(test, feature = "system-allocator"), allow(dead_code))]
extern "C" fn set_allocator_options() {
    for (option, variable, value) in [
        (MI_OPTION_PURGE_DELAY, "MIMALLOC_PURGE_DELAY", 0),
        (
            MI_OPTION_ARENA_EAGER_COMMIT,
            "MIMALLOC_ARENA_EAGER_COMMIT",
            0,
        ),
        (MI_OPTION_GENERIC_COLLECT, "MIMALLOC_GENERIC_COLLECT", 1000),
    ] {
        if std::env::var_os(variable).is_none() {
            // SAFETY: mi_option_set only stores a value in mimalloc's option table (an array of
            // atomics indexed by a valid option number, checked above); it touches no memory of
            // ours and is safe to call from any thread at any time.
            #[allow(unsafe_code)]
            unsafe {
                libmimalloc_sys::mi_option_set(option, value);
            }
        }
    }
}

#[cfg(not(any(test, feature = "system-allocator")))]
#[allow(unsafe_code)]
// SAFETY: a function pointer in `.init_array`, called once by the loader (static or dynamic
// binary alike) before `main`, with no arguments; the function only reads the environment and
// sets three of mimalloc's options.
#[unsafe(link_section = ".init_array")]
#[used]
static SET_ALLOCATOR_OPTIONS: extern "C" fn() = set_allocator_options;

fn main() -> anyhow::Result<()> {
    let cli = nodekeeper_controller::Cli::parse();
    let mut runtime = tokio::runtime::Builder::new_multi_thread();
    runtime.enable_all();
    #[cfg(not(feature = "system-allocator"))]
    runtime.on_thread_park(collect_when_idle);
    runtime.build()?.block_on(nodekeeper_controller::run(cli))?;
    Ok(())
}

/// The shortest time between two collections of one runtime worker's heap ([`collect_when_idle`]).
#[cfg(not(feature = "system-allocator"))]
const IDLE_COLLECT_GAP: std::time::Duration = std::time::Duration::from_secs(2);

/// Called as a runtime worker goes idle: collects its mimalloc heap, at most once a
/// [`IDLE_COLLECT_GAP`]. Memory a worker allocated and another thread freed (a node's report
/// decoded on one worker, replaced on another) goes back to the system only when its owner
/// collects; a worker that a sweep left idle does not reach the 1,000-call trigger above for
/// minutes, and at 10,000 nodes the controller held 66–73 MiB for about two minutes after a
/// restart sweep, against 55–63 once its threads worked again (BENCHMARKS.md § fleet). A
/// collection without `force` frees the pages emptied so far; the gap bounds how often during
/// a sweep, when workers park thousands of times a second.
#[cfg(not(feature = "system-allocator"))]
fn collect_when_idle() {
    use std::cell::Cell;
    use std::time::Instant;
    thread_local! {
        static LAST: Cell<Option<Instant>> = const { Cell::new(None) };
    }
    let now = Instant::now();
    LAST.with(|last| {
        if last
            .get()
            .is_some_and(|at| now.duration_since(at) < IDLE_COLLECT_GAP)
        {
            return;
        }
        last.set(Some(now));
        // SAFETY: mi_collect works on the calling thread's own heap and takes no pointers;
        // mimalloc allows it from any thread at any time.
        #[allow(unsafe_code)]
        unsafe {
            libmimalloc_sys::mi_collect(false);
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A renumbered `mi_option_e` (another mimalloc version) would set other options: the three
    /// numbers must have the defaults of the options meant (options.c: 2, 1000 ms, and 10000).
    #[test]
    fn options_are_the_ones_meant() {
        #[allow(unsafe_code)]
        // SAFETY: mi_option_get reads mimalloc's option table.
        let (eager, delay, collect) = unsafe {
            (
                libmimalloc_sys::mi_option_get(MI_OPTION_ARENA_EAGER_COMMIT),
                libmimalloc_sys::mi_option_get(MI_OPTION_PURGE_DELAY),
                libmimalloc_sys::mi_option_get(MI_OPTION_GENERIC_COLLECT),
            )
        };
        if std::env::var_os("MIMALLOC_GENERIC_COLLECT").is_none() {
            assert_eq!(collect, 10000, "mi_option_generic_collect's default");
        }
        if std::env::var_os("MIMALLOC_ARENA_EAGER_COMMIT").is_none() {
            assert_eq!(eager, 2, "mi_option_arena_eager_commit's default");
        }
        if std::env::var_os("MIMALLOC_PURGE_DELAY").is_none() {
            assert_eq!(delay, 1000, "mi_option_purge_delay's default");
        }
    }
}
