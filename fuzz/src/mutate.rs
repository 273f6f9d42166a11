//! The campaign's mutator: seeded (so a run can be repeated), and aware of text — most of what
//! nodekeeper parses is JSON, YAML or addresses, so besides byte flips it splices inputs,
//! inserts dictionary tokens and multibyte characters, and swaps numbers for extreme ones.

/// xorshift64*: small, fast, and the same sequence on every platform for a given seed.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed.max(1))
    }

    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// A value in `0..n` (`n` > 0).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n.max(1) as u64) as usize
    }

    pub fn chance(&mut self, one_in: usize) -> bool {
        self.below(one_in) == 0
    }
}

/// Tokens every target gets: boundaries, encodings and characters that break naive code.
const COMMON: &[&str] = &[
    "0",
    "-1",
    "1",
    "65535",
    "65536",
    "4294967295",
    "4294967296",
    "18446744073709551615",
    "-9223372036854775808",
    "1e309",
    "NaN",
    "null",
    "true",
    "\"\"",
    "[]",
    "{}",
    "é",
    "日本",
    "🦀",
    "\u{0}",
    "\u{202e}",
    "\\u0000",
    "%",
    "..",
    "/",
    "::",
    "255.255.255.255",
    "169.254.169.254",
    "fe80::1",
    "::ffff:169.254.169.254",
    "0.0.0.0/0",
    "::/0",
];

/// Bytes that carry structure in JSON, YAML and addresses.
const SYNTAX: &[u8] = b"\"{}[]:,-.0123456789 \n\t#'\\";

fn span(rng: &mut Rng, len: usize) -> (usize, usize) {
    if len == 0 {
        return (0, 0);
    }
    let start = rng.below(len);
    let end = start + 1 + rng.below((len - start).min(32));
    (start, end)
}

/// One mutant of `input`: 1 to 8 stacked changes, cut to `max_len`.
pub fn mutate(
    rng: &mut Rng,
    input: &[u8],
    pool: &[Vec<u8>],
    dictionary: &[&str],
    max_len: usize,
) -> Vec<u8> {
    let mut out = input.to_vec();
    for _ in 0..1 + rng.below(8) {
        let len = out.len();
        match rng.below(10) {
            0 if len > 0 => {
                let i = rng.below(len);
                out[i] ^= 1 << rng.below(8);
            }
            1 if len > 0 => {
                let i = rng.below(len);
                out[i] = SYNTAX[rng.below(SYNTAX.len())];
            }
            2 | 3 => {
                let token = if rng.chance(3) || dictionary.is_empty() {
                    COMMON[rng.below(COMMON.len())]
                } else {
                    dictionary[rng.below(dictionary.len())]
                };
                let at = rng.below(len + 1);
                out.splice(at..at, token.bytes());
            }
            4 if len > 0 => {
                let (a, b) = span(rng, len);
                out.drain(a..b);
            }
            5 if len > 0 => {
                let (a, b) = span(rng, len);
                let copy = out[a..b].to_vec();
                let at = rng.below(out.len() + 1);
                out.splice(at..at, copy);
            }
            6 if !pool.is_empty() => {
                // Splice: a prefix of this input and a suffix of another.
                let other = &pool[rng.below(pool.len())];
                let cut = rng.below(len + 1);
                let from = rng.below(other.len() + 1);
                out.truncate(cut);
                out.extend_from_slice(&other[from..]);
            }
            7 => {
                // A run of digits becomes an extreme number.
                if let Some(start) = (0..len)
                    .map(|k| (k + rng.below(len.max(1))) % len.max(1))
                    .find(|&k| out.get(k).is_some_and(u8::is_ascii_digit))
                {
                    let end = (start..len)
                        .find(|&k| !out[k].is_ascii_digit())
                        .unwrap_or(len);
                    let number = COMMON[rng.below(9)];
                    out.splice(start..end, number.bytes());
                }
            }
            8 if len > 0 => {
                // Replace a span with a token of the dictionary.
                let (a, b) = span(rng, len);
                let token = dictionary
                    .get(rng.below(dictionary.len().max(1)))
                    .copied()
                    .unwrap_or("x");
                out.splice(a..b, token.bytes());
            }
            _ => {
                let at = rng.below(len + 1);
                let bytes: Vec<u8> = (0..1 + rng.below(4))
                    .map(|_| rng.next_u64() as u8)
                    .collect();
                out.splice(at..at, bytes);
            }
        }
    }
    out.truncate(max_len);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_seed_gives_the_same_mutants() {
        let pool = vec![b"{\"a\": 12}".to_vec()];
        let run = |seed| {
            let mut rng = Rng::new(seed);
            (0..50)
                .map(|_| mutate(&mut rng, &pool[0], &pool, &["tok"], 64))
                .collect::<Vec<_>>()
        };
        assert_eq!(run(7), run(7));
        assert_ne!(run(7), run(8));
        assert!(run(9).iter().all(|m| m.len() <= 64));
    }
}
