//! Stop strings: where generated text must end, and how much of a partial text can be sent
//! without possibly sending the start of a stop string.

pub struct StopStrings(Vec<String>);

impl StopStrings {
    pub fn new(stops: Vec<String>) -> Self {
        StopStrings(stops.into_iter().filter(|s| !s.is_empty()).collect())
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Bytes of the longest stop string (0 when there is none).
    pub fn longest(&self) -> usize {
        self.0.iter().map(String::len).max().unwrap_or(0)
    }

    /// Byte offset of the earliest stop string in `text`.
    pub fn find(&self, text: &str) -> Option<usize> {
        self.0
            .iter()
            .filter_map(|stop| text.find(stop.as_str()))
            .min()
    }

    /// Length of the longest prefix of `text` that can be sent: everything but a tail that
    /// is the beginning of some stop string (it may complete with the next token).
    pub fn safe_len(&self, text: &str) -> usize {
        let mut safe = text.len();
        for stop in &self.0 {
            // The longest proper prefix of `stop` that `text` ends with.
            for (end, _) in stop.char_indices().skip(1) {
                if text.ends_with(&stop[..end]) {
                    safe = safe.min(text.len() - end);
                }
            }
        }
        safe
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_earliest_stop_and_holds_back_partial_ones() {
        let stops = StopStrings::new(vec!["\n\n".into(), "END".into(), "".into()]);
        assert_eq!(stops.find("abc END x\n\n"), Some(4));
        assert_eq!(stops.find("abc"), None);
        assert_eq!(stops.safe_len("abc EN"), 4);
        assert_eq!(stops.safe_len("abc E"), 4);
        assert_eq!(stops.safe_len("abc\n"), 3);
        assert_eq!(stops.safe_len("abc"), 3);
        assert_eq!(stops.safe_len("é"), "é".len());
        assert!(StopStrings::new(vec![String::new()]).is_empty());
    }
}
