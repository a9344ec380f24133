//! JSON helpers (feature `json`): a value that is not the JSON a guest expects is `None`, never a
//! trap, and a query answers compact JSON.
//!
//! ```
//! #[derive(serde::Deserialize, serde::Serialize)]
//! struct Route {
//!     upstream: String,
//! }
//! let r: Option<Route> = foldhost_guest::json::parse(br#"{"upstream": "10.0.0.1:80"}"#);
//! assert_eq!(r.as_ref().map(|r| r.upstream.as_str()), Some("10.0.0.1:80"));
//! assert!(foldhost_guest::json::parse::<Route>(b"not json").is_none());
//! assert_eq!(foldhost_guest::json::answer(&r.expect("parsed")).unwrap(), br#"{"upstream":"10.0.0.1:80"}"#);
//! ```

/// `bytes` as a `T`, or `None` when they are not the JSON of one.
pub fn parse<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Option<T> {
    serde_json::from_slice(bytes).ok()
}

/// `value` as compact JSON, for a query's answer (the error is a query error).
pub fn answer<T: serde::Serialize>(value: &T) -> Result<Vec<u8>, String> {
    serde_json::to_vec(value).map_err(|e| e.to_string())
}
