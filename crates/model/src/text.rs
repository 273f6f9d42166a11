//! Shortening untrusted text for messages without ever splitting a character: metadata answers,
//! ConfigMap values and agent replies can hold any UTF-8, and a byte slice at a fixed index panics
//! on a multibyte character (and `panic = "abort"` would take the whole process with it).

use std::borrow::Cow;

/// `s` cut to at most `max_bytes` bytes at a character boundary, with `…` appended when cut.
pub fn truncate(s: &str, max_bytes: usize) -> Cow<'_, str> {
    if s.len() <= max_bytes {
        return Cow::Borrowed(s);
    }
    let mut end = max_bytes;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    Cow::Owned(format!("{}…", &s[..end]))
}

#[cfg(test)]
mod tests {
    use super::truncate;

    #[test]
    fn short_text_is_unchanged() {
        assert_eq!(truncate("abc", 3), "abc");
        assert_eq!(truncate("", 0), "");
    }

    #[test]
    fn cuts_at_a_character_boundary() {
        // 'é' is two bytes, '日' three, '🦀' four: every cut point inside one must back off.
        let s = "aé日🦀b".repeat(20);
        for max in 0..s.len() {
            let t = truncate(&s, max);
            let body = t.strip_suffix('…').expect("cut text ends in an ellipsis");
            assert!(body.len() <= max, "{max}: {} bytes", body.len());
            assert!(s.starts_with(body));
        }
    }
}
