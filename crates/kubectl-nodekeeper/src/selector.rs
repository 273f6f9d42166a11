//! kubectl's label-selector syntax (`a=b,c!=d,e in (f,g),h,!i`) turned into the `LabelSelector`
//! a NetworkTest carries. The API server checks keys and values when it lists the matching nodes;
//! this only splits the string into requirements.

use nodekeeper_api::crd::common::LabelSelector;

use crate::error::Error;

/// Parses `selector`; an empty string selects everything. The parser is the api crate's
/// ([`nodekeeper_api::selector::parse`]), shared with the controller's `--node-selector`.
pub fn parse(selector: &str) -> Result<LabelSelector, Error> {
    nodekeeper_api::selector::parse(selector).map_err(|reason| Error::InvalidSelector {
        selector: selector.to_owned(),
        reason,
    })
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
            ("zone>1", "not supported"),
            ("=x", "no valid label key"),
        ] {
            let e = parse(bad).unwrap_err().to_string();
            assert!(e.contains(needle), "{bad}: {e}");
            assert!(e.starts_with(&format!("invalid selector {bad:?}")), "{e}");
        }
    }
}
