//! The skipped-test contract (the project's testing rules, README "Try it"): a test that cannot run here prints
//! `SKIPPED: <test>: <reason>` on stdout and returns, so CI (which runs as root) can tell a skip
//! from a pass.

/// Whether this process runs as root (what network namespaces, qemu and raw sockets need).
pub fn is_root() -> bool {
    nix::unistd::geteuid().is_root()
}

/// What a skipped test returns: `()` or `Ok(())`.
pub trait Skipped {
    fn skipped() -> Self;
}

impl Skipped for () {
    fn skipped() -> Self {}
}

impl<E> Skipped for Result<(), E> {
    fn skipped() -> Self {
        Ok(())
    }
}

/// The test's name from the path of an item declared in its body (`crate::test_fn::{{closure}}::f`
/// for an async test): the last path segment that is neither the marker nor a closure.
#[doc(hidden)]
pub fn test_name(marker_path: &'static str) -> &'static str {
    marker_path
        .rsplit("::")
        .find(|s| *s != "__skip_marker" && !s.starts_with('{'))
        .unwrap_or(marker_path)
}

#[doc(hidden)]
pub fn type_name_of<T>(_: T) -> &'static str {
    std::any::type_name::<T>()
}

/// Prints the SKIPPED line. The line is the contract with CI, so it goes to stdout.
#[doc(hidden)]
#[allow(clippy::print_stdout)]
pub fn print_skipped(test: &str, reason: &str) {
    println!("SKIPPED: {test}: {reason}");
}

/// Skips the calling test: prints `SKIPPED: <test>: <reason>` and returns `()` or `Ok(())`.
#[macro_export]
macro_rules! skip {
    ($reason:expr) => {{
        fn __skip_marker() {}
        $crate::skip::print_skipped(
            $crate::skip::test_name($crate::skip::type_name_of(__skip_marker)),
            &$reason,
        );
        return $crate::skip::Skipped::skipped();
    }};
}

/// Skips the calling test unless it runs as root: `skip_unless_root!("needs root to create
/// network namespaces");` prints `SKIPPED: <test>: <reason>` and returns `()` or `Ok(())`.
#[macro_export]
macro_rules! skip_unless_root {
    ($reason:expr) => {
        if !$crate::skip::is_root() {
            $crate::skip!($reason);
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_test_name_is_the_enclosing_function() {
        fn __skip_marker() {}
        assert_eq!(
            test_name(type_name_of(__skip_marker)),
            "the_test_name_is_the_enclosing_function"
        );
        assert_eq!(
            test_name("crate_x::tests::an_async_test::{{closure}}::__skip_marker"),
            "an_async_test"
        );
    }

    fn skipping() -> Result<(), String> {
        crate::skip!(format!("reason {}", 1));
    }

    #[test]
    fn a_skip_returns_ok() {
        assert_eq!(skipping(), Ok(()));
    }
}
