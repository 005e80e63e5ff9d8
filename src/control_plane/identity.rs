//! Who may report as which node: the names a node's credentials bind it to, and the shape
//! every name and report field must have before anything is stored or logged.
//!
//! A node proves its name one of two ways:
//! - **mTLS** (`tls_client_ca`): its client certificate carries a URI subject alternative
//!   name `moe-node://CLUSTER/NODE` (several are allowed, one per name it may use), and a
//!   report is taken only for a name the certificate carries. The URI form keeps the name
//!   apart from the host names a certificate may also hold, and names the cluster too.
//! - **Scoped tokens** (`[[node_tokens]]`): each token hash names a cluster and, optionally,
//!   one node of it; a report is taken only for that cluster (and node).
//!
//! Names are 1 to [`MAX_NAME`] characters of `A-Z a-z 0-9 . _ -` (not starting with `.`):
//! they go into the log, the status page, URLs and the database, and nothing else needs
//! more. Every other string of a report is bounded by [`MAX_FIELD`] and has no control
//! character.

use serde::{Deserialize, Serialize};

use super::wire::Report;

/// Longest cluster or node name.
pub const MAX_NAME: usize = 64;
/// Longest free-text field of a report (version, phase, model, fingerprint).
pub const MAX_FIELD: usize = 256;
/// The URI scheme of a node's name in its client certificate.
pub const URI_PREFIX: &str = "moe-node://";

/// A node token's hash and what it may report as.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeToken {
    /// SHA-256 (hex) of the token.
    pub sha256: String,
    /// The cluster its holder reports under.
    pub cluster: String,
    /// The one node its holder reports as; empty: any node of `cluster`.
    #[serde(default)]
    pub node: String,
}

impl NodeToken {
    /// Whether this token lets its holder report as `node` of `cluster`.
    pub fn allows(&self, cluster: &str, node: &str) -> bool {
        self.cluster == cluster && (self.node.is_empty() || self.node == node)
    }
}

/// Why a name is refused, or `None` when it is a valid cluster or node name.
pub fn name_problem(name: &str) -> Option<String> {
    if name.is_empty() || name.len() > MAX_NAME {
        return Some(format!("1 to {MAX_NAME} characters"));
    }
    if name.starts_with('.')
        || !name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
    {
        return Some("only letters, digits, '.', '_' and '-' (not starting with '.')".into());
    }
    None
}

/// Why a report is refused (its names, or a field too long or with control characters).
pub fn report_problem(report: &Report) -> Option<String> {
    for (what, name) in [("cluster", &report.cluster), ("node", &report.node)] {
        if let Some(problem) = name_problem(name) {
            return Some(format!("{what}: {problem}"));
        }
    }
    for (what, text) in [
        ("version", &report.version),
        ("phase", &report.phase),
        ("model", &report.model),
        ("model_fingerprint", &report.model_fingerprint),
    ] {
        if let Some(problem) = text_problem(text) {
            return Some(format!("{what}: {problem}"));
        }
    }
    if !report.imbalance.is_finite() {
        return Some("imbalance: not a number".into());
    }
    None
}

/// Why a free-text field is refused: over [`MAX_FIELD`] bytes or with a control character.
pub fn text_problem(text: &str) -> Option<String> {
    if text.len() > MAX_FIELD {
        return Some(format!("at most {MAX_FIELD} bytes"));
    }
    if text.chars().any(char::is_control) {
        return Some("no control characters".into());
    }
    None
}

/// The (cluster, node) names a DER client certificate carries as `moe-node://` URIs.
/// A certificate that does not parse carries none.
pub fn certificate_names(der: &[u8]) -> Vec<(String, String)> {
    let Ok((_, certificate)) = x509_parser::parse_x509_certificate(der) else {
        return Vec::new();
    };
    let Ok(Some(names)) = certificate.subject_alternative_name() else {
        return Vec::new();
    };
    names
        .value
        .general_names
        .iter()
        .filter_map(|name| match name {
            x509_parser::extensions::GeneralName::URI(uri) => parse_uri(uri),
            _ => None,
        })
        .collect()
}

/// `moe-node://CLUSTER/NODE` as (cluster, node), both valid names.
pub fn parse_uri(uri: &str) -> Option<(String, String)> {
    let (cluster, node) = uri.strip_prefix(URI_PREFIX)?.split_once('/')?;
    if name_problem(cluster).is_some() || name_problem(node).is_some() {
        return None;
    }
    Some((cluster.to_string(), node.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_short_plain_and_printable() {
        for good in ["n1", "node-1.rack_2", "a", &"x".repeat(MAX_NAME)] {
            assert_eq!(name_problem(good), None, "{good}");
        }
        for bad in [
            "",
            "node\nforged log line",
            "a b",
            "../etc",
            ".hidden",
            "n\u{7f}",
            "é",
            &"x".repeat(MAX_NAME + 1),
        ] {
            assert!(name_problem(bad).is_some(), "{bad:?}");
        }
    }

    #[test]
    fn a_report_with_a_huge_or_control_field_is_refused() {
        let good = Report {
            cluster: "c1".into(),
            node: "n1".into(),
            phase: "ready".into(),
            ..Report::default()
        };
        assert_eq!(report_problem(&good), None);
        let huge = Report {
            phase: "x".repeat(900_000),
            ..good.clone()
        };
        assert!(report_problem(&huge).is_some_and(|p| p.starts_with("phase:")));
        let forged = Report {
            model: "m\r\nINFO fake".into(),
            ..good.clone()
        };
        assert!(report_problem(&forged).is_some_and(|p| p.starts_with("model:")));
        let newline = Report {
            node: "n1\nn2".into(),
            ..good
        };
        assert!(report_problem(&newline).is_some_and(|p| p.starts_with("node:")));
    }

    #[test]
    fn uris_name_a_cluster_and_a_node() {
        assert_eq!(
            parse_uri("moe-node://prod/node-7"),
            Some(("prod".into(), "node-7".into()))
        );
        for bad in [
            "moe-node://prod",
            "moe-node://prod/",
            "moe-node://prod/a/b",
            "https://prod/node",
            "moe-node:///node",
        ] {
            assert_eq!(parse_uri(bad), None, "{bad}");
        }
    }

    #[test]
    fn tokens_are_scoped_to_a_cluster_or_one_node() {
        let cluster = NodeToken {
            sha256: String::new(),
            cluster: "a".into(),
            node: String::new(),
        };
        let node = NodeToken {
            node: "n1".into(),
            ..cluster.clone()
        };
        assert!(cluster.allows("a", "anything"));
        assert!(!cluster.allows("b", "n1"));
        assert!(node.allows("a", "n1"));
        assert!(!node.allows("a", "n2"));
    }

    #[test]
    fn a_certificate_names_its_node_by_uri() {
        let key = rcgen::KeyPair::generate().expect("key");
        let mut params = rcgen::CertificateParams::new(vec!["n1".to_string()]).expect("params");
        params.subject_alt_names.push(rcgen::SanType::URI(
            "moe-node://c1/n1".try_into().expect("uri"),
        ));
        params.subject_alt_names.push(rcgen::SanType::URI(
            "https://example.com/".try_into().expect("uri"),
        ));
        let certificate = params.self_signed(&key).expect("certificate");
        assert_eq!(
            certificate_names(certificate.der()),
            vec![("c1".to_string(), "n1".to_string())]
        );
        assert!(certificate_names(b"not a certificate").is_empty());
    }
}
