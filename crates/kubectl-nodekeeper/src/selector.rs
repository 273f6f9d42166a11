//! kubectl's label-selector syntax (`a=b,c!=d,e in (f,g),h,!i`) turned into the `LabelSelector`
//! a NetworkTest carries. The API server checks keys and values when it lists the matching nodes;
//! this only splits the string into requirements.

use nodekeeper_api::crd::common::{LabelSelector, LabelSelectorRequirement, SelectorOperator};

use crate::error::Error;

/// Parses `selector`; an empty string selects everything.
pub fn parse(selector: &str) -> Result<LabelSelector, Error> {
    let invalid = |reason: String| Error::InvalidSelector {
        selector: selector.to_owned(),
        reason,
    };
    let mut out = LabelSelector::default();
    for term in split_terms(selector).map_err(&invalid)? {
        let term = term.trim();
        if term.is_empty() {
            return Err(invalid("empty requirement (two commas in a row?)".into()));
        }
        let requirement = |key: &str, operator, values: Vec<String>| {
            let key = key.trim();
            if key.is_empty() || key.contains(char::is_whitespace) {
                return Err(invalid(format!("{term:?} has no valid label key")));
            }
            Ok(LabelSelectorRequirement {
                key: key.to_owned(),
                operator,
                values,
            })
        };
        if let Some(key) = term.strip_prefix('!') {
            out.match_expressions
                .push(requirement(key, SelectorOperator::DoesNotExist, vec![])?);
        } else if let Some((key, values)) = set_term(term, " notin ") {
            let values = values.map_err(&invalid)?;
            out.match_expressions
                .push(requirement(key, SelectorOperator::NotIn, values)?);
        } else if let Some((key, values)) = set_term(term, " in ") {
            let values = values.map_err(&invalid)?;
            out.match_expressions
                .push(requirement(key, SelectorOperator::In, values)?);
        } else if let Some((key, value)) = term.split_once("!=") {
            out.match_expressions.push(requirement(
                key,
                SelectorOperator::NotIn,
                vec![value.trim().to_owned()],
            )?);
        } else if let Some((key, value)) = term.split_once("==").or_else(|| term.split_once('=')) {
            let key = requirement(key, SelectorOperator::Exists, vec![])?.key;
            let value = value.trim();
            if value.contains(char::is_whitespace) {
                return Err(invalid(format!("{term:?}: a value has no spaces")));
            }
            if out
                .match_labels
                .insert(key.clone(), value.to_owned())
                .is_some()
            {
                return Err(invalid(format!("label {key:?} given twice")));
            }
        } else {
            out.match_expressions
                .push(requirement(term, SelectorOperator::Exists, vec![])?);
        }
    }
    Ok(out)
}

/// Splits on commas outside parentheses.
fn split_terms(selector: &str) -> Result<Vec<&str>, String> {
    if selector.trim().is_empty() {
        return Ok(Vec::new());
    }
    let mut terms = Vec::new();
    let (mut depth, mut start) = (0i32, 0usize);
    for (i, c) in selector.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                terms.push(&selector[start..i]);
                start = i + 1;
            }
            _ => {}
        }
        if !(0..=1).contains(&depth) {
            return Err("unbalanced parentheses".into());
        }
    }
    if depth != 0 {
        return Err("unbalanced parentheses".into());
    }
    terms.push(&selector[start..]);
    Ok(terms)
}

/// `key in (a,b)` → (`key`, [a, b]).
fn set_term<'a>(term: &'a str, op: &str) -> Option<(&'a str, Result<Vec<String>, String>)> {
    let (key, rest) = term.split_once(op)?;
    let rest = rest.trim();
    let values = rest
        .strip_prefix('(')
        .and_then(|r| r.strip_suffix(')'))
        .map(|inner| {
            inner
                .split(',')
                .map(|v| v.trim().to_owned())
                .filter(|v| !v.is_empty())
                .collect::<Vec<_>>()
        })
        .filter(|v| !v.is_empty())
        .ok_or_else(|| format!("{term:?}: write the values as ({})", "a,b"));
    Some((key, values))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kubectl_form_round_trips_through_the_query_string() {
        let s =
            parse("pool=gpu, zone in (a,b),tier!=web,ssd,!spot,env==prod,rack notin (r1)").unwrap();
        assert_eq!(
            s.to_query(),
            "env=prod,pool=gpu,zone in (a,b),tier notin (web),ssd,!spot,rack notin (r1)"
        );
        assert_eq!(parse("").unwrap(), LabelSelector::default());
    }

    #[test]
    fn malformed_selectors_name_the_problem() {
        for (bad, needle) in [
            ("a=b,,c", "empty requirement"),
            ("zone in a,b", "write the values as"),
            ("zone in (a", "unbalanced"),
            ("a=b,a=c", "given twice"),
            ("=x", "no valid label key"),
        ] {
            let e = parse(bad).unwrap_err().to_string();
            assert!(e.contains(needle), "{bad}: {e}");
            assert!(e.starts_with(&format!("invalid selector {bad:?}")), "{e}");
        }
    }
}
