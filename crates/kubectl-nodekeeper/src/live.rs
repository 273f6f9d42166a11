//! Progress while a verb waits: on a terminal, a block of lines on stderr redrawn in place; when
//! stderr is not a terminal, each line once, when it first appears or changes — stable text a
//! log or a CI job can keep (no spinner, no elapsed time, no escape codes). Nothing for `-o
//! json|yaml`, whose readers want stdout alone.

use std::io::Write as _;

use crate::render::Output;

pub struct Live {
    tty: bool,
    on: bool,
    drawn: usize,
    printed: std::collections::HashSet<String>,
    frame: usize,
}

impl Live {
    pub fn new(out: &Output) -> Live {
        Live {
            tty: out.progress,
            on: out.progress || out.structured(&()).is_none(),
            drawn: 0,
            printed: Default::default(),
            frame: 0,
        }
    }

    /// Shows `lines`; `header` only on a terminal (it may carry a spinner and a clock).
    pub fn show(&mut self, header: &str, lines: &[String]) {
        if !self.on {
            return;
        }
        let mut err = std::io::stderr().lock();
        if self.tty {
            const FRAMES: [char; 4] = ['|', '/', '-', '\\'];
            self.frame = (self.frame + 1) % FRAMES.len();
            let mut text = self.erase_text();
            text.push_str(&format!("{} {header}\n", FRAMES[self.frame]));
            for line in lines {
                text.push_str(&format!("  {line}\n"));
            }
            self.drawn = lines.len() + 1;
            let _ = err.write_all(text.as_bytes());
        } else {
            for line in lines {
                if self.printed.insert(line.clone()) {
                    let _ = writeln!(err, "{line}");
                }
            }
        }
        let _ = err.flush();
    }

    /// A line kept in a log: printed when stderr is not a terminal (on one, the final output
    /// says the same).
    pub fn note(&mut self, line: &str) {
        if self.on && !self.tty {
            eprint_line(line);
        }
    }

    /// Removes the block from a terminal.
    pub fn clear(&mut self) {
        if self.tty && self.drawn > 0 {
            let text = self.erase_text();
            let _ = std::io::stderr().lock().write_all(text.as_bytes());
            self.drawn = 0;
        }
    }

    fn erase_text(&self) -> String {
        if self.drawn == 0 {
            String::new()
        } else {
            // Up to the block's first line, then erase to the end of the screen.
            format!("\x1b[{}F\x1b[J", self.drawn)
        }
    }
}

/// SIGINT and SIGTERM, registered before anything is created so an interrupt is always the
/// verb's to handle.
pub struct Interrupts {
    interrupt: tokio::signal::unix::Signal,
    terminate: tokio::signal::unix::Signal,
}

impl Interrupts {
    pub fn register() -> Result<Interrupts, crate::Error> {
        use tokio::signal::unix::{SignalKind, signal};
        Ok(Interrupts {
            interrupt: signal(SignalKind::interrupt()).map_err(crate::Error::StartRuntime)?,
            terminate: signal(SignalKind::terminate()).map_err(crate::Error::StartRuntime)?,
        })
    }

    /// Resolves when either signal arrives; says which.
    pub async fn recv(&mut self) -> &'static str {
        tokio::select! {
            _ = self.interrupt.recv() => "interrupted",
            _ = self.terminate.recv() => "terminated",
        }
    }
}

/// One line on stderr, ignoring a closed stderr.
pub fn eprint_line(line: &str) {
    let _ = writeln!(std::io::stderr().lock(), "{line}");
}
