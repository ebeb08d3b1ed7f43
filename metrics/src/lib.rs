//! Metric definitions (filled by the observability work).
