//! node-problem-detector's system-log-monitor rule files (`kernel-monitor.json`,
//! `readonly-monitor.json`, custom ones) read unchanged, and the matching NPD does: each new log
//! line is pushed into a buffer of the last `bufferSize` lines, and every rule's pattern must match
//! the buffer's joined text *at its end* (so a pattern can span lines, and only a line that
//! completes a match fires). A temporary rule records a problem; a permanent rule sets its
//! condition `True` with the rule's reason, the message being the matched lines.

use std::collections::VecDeque;
use std::time::{Duration, SystemTime};

use regex::Regex;
use serde::Deserialize;

use super::state::{ConditionDefault, ConditionStatus, ProblemState, RuleType};
use super::{MonitorError, MonitorFile, invalid, parse_go_duration, parse_json};

/// NPD's default `bufferSize`.
const DEFAULT_BUFFER_SIZE: usize = 10;
/// Larger buffers are refused: every line is matched against the joined buffer.
pub const MAX_BUFFER_SIZE: usize = 100;
/// Rules per file beyond this are refused (each costs a regex match per log line).
pub const MAX_RULES: usize = 256;
/// A compiled pattern may not exceed this size (the regex crate's guard against huge automata).
const MAX_REGEX_BYTES: usize = 1 << 20;

/// The JSON of a system-log-monitor file, as NPD reads it. Unknown fields are ignored, as Go's
/// encoding/json does.
#[derive(Clone, Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LogMonitorFile {
    #[serde(flatten)]
    pub common: MonitorFile,
    #[serde(default)]
    pub log_path: String,
    #[serde(default)]
    pub lookback: String,
    #[serde(default)]
    pub delay: String,
    #[serde(default)]
    pub buffer_size: usize,
    /// `journald` files name the `SYSLOG_IDENTIFIER` they read in `pluginConfig.source`.
    #[serde(default)]
    pub plugin_config: Option<JournaldConfig>,
}

/// `pluginConfig` of a `journald` file.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct JournaldConfig {
    #[serde(default)]
    pub source: String,
}

/// One entry of `rules[]`.
#[derive(Clone, Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LogRule {
    #[serde(rename = "type")]
    pub kind: RuleType,
    #[serde(default)]
    pub condition: String,
    pub reason: String,
    pub pattern: String,
    #[serde(default)]
    pub pattern_generated_message_suffix: String,
}

#[derive(Debug)]
struct CompiledRule {
    rule: LogRule,
    /// `pattern` followed by `\z`, exactly as NPD builds it (no group around the pattern, so a
    /// top-level alternation anchors only its last branch, as in NPD).
    regex: Regex,
}

/// A loaded rule file: its accepted rules and its line buffer.
#[derive(Debug)]
pub struct LogMonitor {
    pub source: String,
    /// For a `journald` file, the `SYSLOG_IDENTIFIER` it reads (`pluginConfig.source`); `None`
    /// for a `kmsg` file.
    pub identifier: Option<String>,
    /// The file's `logPath` (a journal directory for `journald` files; unused for `kmsg`).
    pub log_path: String,
    pub conditions: Vec<ConditionDefault>,
    /// Lines stamped before `boot + delay` or `now - lookback` (whichever is later) are skipped.
    pub lookback: Duration,
    pub delay: Duration,
    rules: Vec<CompiledRule>,
    buffer: VecDeque<String>,
    buffer_size: usize,
}

/// A refused part of a file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RuleRefusal {
    pub item: String,
    pub reason: String,
}

impl LogMonitor {
    /// Parses a rule file (`"plugin": "kmsg"` or `"journald"`). A file that is not a log
    /// monitor at all is an error; a single bad rule (invalid regex, a permanent rule naming an
    /// undeclared condition, …) is refused and listed while the others load.
    pub fn parse(
        origin: &str,
        json: &[u8],
    ) -> Result<(LogMonitor, Vec<RuleRefusal>), MonitorError> {
        let file: LogMonitorFile = parse_json(origin, json)?;
        let invalid = |field: &str, reason: String| invalid(origin, field, reason);
        let journald = file.common.plugin == "journald";
        let MonitorFile {
            source,
            conditions,
            rules: raw_rules,
            ..
        } = file
            .common
            .checked(origin, if journald { "journald" } else { "kmsg" })?;
        let identifier = if journald {
            match file.plugin_config.as_ref().map(|c| c.source.trim()) {
                Some(s) if !s.is_empty() => Some(s.to_owned()),
                _ => {
                    return Err(invalid(
                        "pluginConfig.source",
                        "must name the SYSLOG_IDENTIFIER to read (e.g. \"systemd\")".into(),
                    ));
                }
            }
        } else {
            None
        };
        let buffer_size = match file.buffer_size {
            0 => DEFAULT_BUFFER_SIZE,
            n if n > MAX_BUFFER_SIZE => {
                return Err(invalid(
                    "bufferSize",
                    format!("{n} exceeds {MAX_BUFFER_SIZE}; use a smaller buffer"),
                ));
            }
            n => n,
        };
        let duration = |field: &str, text: &str| -> Result<Duration, MonitorError> {
            if text.is_empty() {
                return Ok(Duration::ZERO);
            }
            parse_go_duration(text).map_err(|reason| invalid(field, reason))
        };
        let lookback = duration("lookback", &file.lookback)?;
        let delay = duration("delay", &file.delay)?;

        let mut refusals = Vec::new();
        let mut rules = Vec::new();
        for (i, value) in raw_rules.into_iter().enumerate() {
            let item = format!("rules[{i}]");
            if i >= MAX_RULES {
                refusals.push(RuleRefusal {
                    item,
                    reason: format!("more than {MAX_RULES} rules in one file"),
                });
                continue;
            }
            let rule: LogRule = match serde_json::from_value(value) {
                Ok(rule) => rule,
                Err(e) => {
                    refusals.push(RuleRefusal {
                        item,
                        reason: format!("not a rule: {e}"),
                    });
                    continue;
                }
            };
            match compile(&rule, &conditions) {
                Ok(regex) => rules.push(CompiledRule { rule, regex }),
                Err(reason) => refusals.push(RuleRefusal {
                    item: format!("{item} ({})", rule.reason),
                    reason,
                }),
            }
        }
        Ok((
            LogMonitor {
                source,
                identifier,
                log_path: file.log_path,
                conditions,
                lookback,
                delay,
                rules,
                buffer: VecDeque::with_capacity(buffer_size),
                buffer_size,
            },
            refusals,
        ))
    }

    /// The rules that loaded.
    pub fn rule_count(&self) -> usize {
        self.rules.len()
    }

    /// Declares this file's conditions (healthy) in `state`.
    pub fn declare(&self, state: &mut ProblemState, now: SystemTime) {
        for c in &self.conditions {
            state.declare(&self.source, c, now);
        }
        for r in &self.rules {
            state.init_counter(&r.rule.reason);
        }
    }

    /// Turns this file's conditions that are not `True` `Unknown` with `why`: the log cannot be
    /// read, so it is not known to be healthy. A condition already `True` stays: what the log
    /// showed on this boot is still so.
    pub fn unknown(&self, why: &str, state: &mut ProblemState, now: SystemTime) {
        for c in &self.conditions {
            if state
                .condition(&c.kind)
                .is_some_and(|have| have.status != ConditionStatus::True)
            {
                state.set_condition(&c.kind, ConditionStatus::Unknown, &c.reason, why, now);
            }
        }
    }

    /// Turns this file's `Unknown` conditions back to healthy once the log can be read again
    /// (the lines read next set them `True` where they show a problem).
    pub fn known(&self, state: &mut ProblemState, now: SystemTime) {
        for c in &self.conditions {
            if state
                .condition(&c.kind)
                .is_some_and(|have| have.status == ConditionStatus::Unknown)
            {
                state.set_condition(&c.kind, ConditionStatus::False, &c.reason, &c.message, now);
            }
        }
    }

    /// The earliest log timestamp this monitor acts on, from boot time and now (NPD's start time).
    pub fn start_time(&self, boot: SystemTime, now: SystemTime) -> SystemTime {
        let after_delay = super::add_or_never(boot, self.delay);
        let after_lookback = now
            .checked_sub(self.lookback)
            .unwrap_or(SystemTime::UNIX_EPOCH);
        after_delay.max(after_lookback)
    }

    /// Pushes one log line (already trimmed) and applies every rule that now matches.
    /// Returns how many rules fired.
    pub fn process(&mut self, message: &str, at: SystemTime, state: &mut ProblemState) -> usize {
        if self.buffer.len() == self.buffer_size {
            self.buffer.pop_front();
        }
        self.buffer.push_back(message.to_owned());
        if self.rules.is_empty() {
            return 0;
        }
        let joined = self
            .buffer
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>()
            .join("\n");
        let mut fired = 0;
        for compiled in &self.rules {
            let Some(found) = compiled.regex.find(&joined) else {
                continue;
            };
            fired += 1;
            let message = matched_lines(&self.buffer, found.start());
            let message = if compiled.rule.pattern_generated_message_suffix.is_empty() {
                message
            } else {
                format!(
                    "{message}; {}",
                    compiled.rule.pattern_generated_message_suffix
                )
            };
            let rule = &compiled.rule;
            match rule.kind {
                RuleType::Temporary => state.record(&self.source, &rule.reason, &message, at),
                RuleType::Permanent => {
                    state.set_condition(
                        &rule.condition,
                        ConditionStatus::True,
                        &rule.reason,
                        &message,
                        at,
                    );
                }
            }
        }
        fired
    }
}

/// The buffered lines from the one containing byte `start` of the joined text to the last,
/// joined with newlines (NPD's event message).
fn matched_lines(buffer: &VecDeque<String>, start: usize) -> String {
    let mut offset = 0;
    let mut first = buffer.len().saturating_sub(1);
    for (i, line) in buffer.iter().enumerate() {
        // A match starting on the separator after a line belongs to the next line.
        if start < offset + line.len() || (start == offset && line.is_empty()) {
            first = i;
            break;
        }
        offset += line.len() + 1;
    }
    buffer
        .iter()
        .skip(first)
        .map(String::as_str)
        .collect::<Vec<_>>()
        .join("\n")
}

fn compile(rule: &LogRule, conditions: &[ConditionDefault]) -> Result<Regex, String> {
    if rule.reason.is_empty() {
        return Err("reason is empty; every rule needs a reason".into());
    }
    if rule.kind == RuleType::Permanent && !conditions.iter().any(|c| c.kind == rule.condition) {
        return Err(format!(
            "condition {:?} is not declared in conditions[]; add it there with its healthy reason",
            rule.condition
        ));
    }
    // Go's RE2 and the regex crate share their syntax; one difference is that `\w`, `\d` and
    // `\s` are Unicode-aware here, which only widens matches on non-ASCII text.
    regex::RegexBuilder::new(&format!("{}\\z", rule.pattern))
        .size_limit(MAX_REGEX_BYTES)
        .build()
        .map_err(|e| format!("pattern {:?} is not a valid regex: {e}", rule.pattern))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn monitor(rules: &str, buffer: usize) -> (LogMonitor, Vec<RuleRefusal>) {
        let json = format!(
            r#"{{"plugin":"kmsg","source":"t","bufferSize":{buffer},
                "conditions":[{{"type":"C","reason":"Fine","message":"fine"}}],
                "rules":{rules}}}"#
        );
        LogMonitor::parse("t.json", json.as_bytes()).unwrap()
    }

    #[test]
    fn a_pattern_spanning_lines_reports_the_matched_lines() {
        let (mut m, refused) = monitor(
            r#"[{"type":"temporary","reason":"Two","pattern":"first\nsecond"}]"#,
            3,
        );
        assert!(refused.is_empty());
        let mut s = ProblemState::default();
        let t = SystemTime::UNIX_EPOCH;
        assert_eq!(m.process("zero", t, &mut s), 0);
        assert_eq!(m.process("first", t, &mut s), 0);
        assert_eq!(m.process("second", t, &mut s), 1);
        assert_eq!(s.recent().last().unwrap().message, "first\nsecond");
        // Only the line that completes a match fires.
        assert_eq!(m.process("third", t, &mut s), 0);
    }

    #[test]
    fn bad_rules_are_refused_and_the_rest_load() {
        let (m, refused) = monitor(
            r#"[{"type":"temporary","reason":"Bad","pattern":"(unclosed"},
                {"type":"permanent","condition":"Nope","reason":"X","pattern":"x"},
                {"type":"sometimes","reason":"Y","pattern":"y"},
                {"type":"permanent","condition":"C","reason":"Good","pattern":"good"}]"#,
            0,
        );
        assert_eq!(m.rule_count(), 1);
        let items: Vec<_> = refused.iter().map(|r| r.item.as_str()).collect();
        assert_eq!(items, ["rules[0] (Bad)", "rules[1] (X)", "rules[2]"]);
        assert!(
            refused[0].reason.contains("not a valid regex"),
            "{}",
            refused[0].reason
        );
        assert!(
            refused[1].reason.contains("not declared"),
            "{}",
            refused[1].reason
        );
    }

    #[test]
    fn a_file_for_another_plugin_is_refused_whole() {
        let err = LogMonitor::parse("f.json", br#"{"plugin":"filelog","source":"s"}"#).unwrap_err();
        assert!(err.to_string().contains("plugin"), "{err}");
        let err =
            LogMonitor::parse("j.json", br#"{"plugin":"journald","source":"s"}"#).unwrap_err();
        assert!(err.to_string().contains("pluginConfig.source"), "{err}");
        let err = LogMonitor::parse(
            "b.json",
            br#"{"plugin":"kmsg","source":"s","bufferSize":1000}"#,
        )
        .unwrap_err();
        assert!(err.to_string().contains("bufferSize"), "{err}");
    }

    #[test]
    fn start_time_is_the_later_of_delay_and_lookback() {
        let (mut m, _) = monitor("[]", 0);
        let boot = SystemTime::UNIX_EPOCH + Duration::from_secs(1000);
        let now = boot + Duration::from_secs(3600);
        assert_eq!(m.start_time(boot, now), now);
        m.lookback = Duration::from_secs(300);
        assert_eq!(m.start_time(boot, now), now - Duration::from_secs(300));
        m.delay = Duration::from_secs(3500);
        assert_eq!(m.start_time(boot, now), boot + Duration::from_secs(3500));
    }
}
