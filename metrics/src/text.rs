//! The Prometheus text exposition format 0.0.4, written byte for byte as Go's client_golang
//! (`expfmt.MetricFamilyToText`) writes it, so nftproxy's `/metrics` reads like kube-proxy's:
//! families sorted by name, series by label values, label names sorted with `le` last, sample
//! values formatted like Go's `strconv.FormatFloat(v, 'g', -1, 64)`, bucket and sample counts as
//! plain integers, empty families left out.

use std::cmp::Ordering;
use std::fmt::Write;

use prometheus::proto::{LabelPair, Metric, MetricFamily, MetricType};

/// The `Content-Type` of this format.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Formats a float as client_golang writes sample values: Go's
/// `strconv.FormatFloat(v, 'g', -1, 64)` (the shortest digits that read back as `v`, in
/// exponent form when the decimal exponent is below -4 or at least 6) with the special cases
/// `0`, `+Inf`, `-Inf` and `NaN`.
pub fn go_float(v: f64) -> String {
    if v.is_nan() {
        return "NaN".into();
    }
    if v.is_infinite() {
        return if v > 0.0 {
            "+Inf".into()
        } else {
            "-Inf".into()
        };
    }
    if v == 0.0 {
        return "0".into();
    }
    // Rust's `{:e}` prints the shortest round-tripping digits, like Go's shortest mode.
    let sci = format!("{:e}", v.abs());
    let (mantissa, exp) = sci.split_once('e').expect("{:e} always has an exponent");
    let exp: i32 = exp.parse().expect("{:e} exponent is an integer");
    let digits: String = mantissa.chars().filter(char::is_ascii_digit).collect();
    let nd = digits.len();
    let mut out = String::new();
    if v < 0.0 {
        out.push('-');
    }
    // Go's %g with shortest precision decides on precision 6.
    let eprec = 6;
    if exp < -4 || exp >= eprec {
        out.push_str(&digits[..1]);
        if nd > 1 {
            out.push('.');
            out.push_str(&digits[1..]);
        }
        out.push('e');
        out.push(if exp < 0 { '-' } else { '+' });
        let _ = write!(out, "{:02}", exp.abs());
    } else if exp < 0 {
        out.push_str("0.");
        for _ in 0..(-exp - 1) {
            out.push('0');
        }
        out.push_str(&digits);
    } else {
        let int_len = (exp + 1) as usize;
        if digits.len() <= int_len {
            out.push_str(&digits);
            for _ in digits.len()..int_len {
                out.push('0');
            }
        } else {
            out.push_str(&digits[..int_len]);
            out.push('.');
            out.push_str(&digits[int_len..]);
        }
    }
    out
}

fn escape_help(s: &str, out: &mut String) {
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
}

fn escape_label_value(s: &str, out: &mut String) {
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '"' => out.push_str("\\\""),
            c => out.push(c),
        }
    }
}

fn sorted_labels(m: &Metric) -> Vec<&LabelPair> {
    let mut labels: Vec<&LabelPair> = m.get_label().iter().collect();
    labels.sort_by(|a, b| a.name().cmp(b.name()));
    labels
}

fn compare_series(a: &Metric, b: &Metric) -> Ordering {
    let (la, lb) = (sorted_labels(a), sorted_labels(b));
    for (x, y) in la.iter().zip(lb.iter()) {
        let o = x.value().cmp(y.value());
        if o != Ordering::Equal {
            return o;
        }
    }
    la.len().cmp(&lb.len())
}

/// `name{labels[,extra]} value\n`
fn sample(
    out: &mut String,
    name: &str,
    suffix: &str,
    labels: &[&LabelPair],
    extra: Option<(&str, &str)>,
    value: &str,
) {
    out.push_str(name);
    out.push_str(suffix);
    if !labels.is_empty() || extra.is_some() {
        out.push('{');
        let mut first = true;
        let pairs = labels.iter().map(|l| (l.name(), l.value())).chain(extra);
        for (k, v) in pairs {
            if !first {
                out.push(',');
            }
            first = false;
            out.push_str(k);
            out.push_str("=\"");
            escape_label_value(v, out);
            out.push('"');
        }
        out.push('}');
    }
    out.push(' ');
    out.push_str(value);
    out.push('\n');
}

/// Encodes gathered families.
pub fn encode(families: &[MetricFamily]) -> String {
    let mut families: Vec<&MetricFamily> = families
        .iter()
        .filter(|f| !f.get_metric().is_empty())
        .collect();
    families.sort_by(|a, b| a.name().cmp(b.name()));
    let mut out = String::new();
    for mf in families {
        let name = mf.name();
        let kind = match mf.get_field_type() {
            MetricType::COUNTER => "counter",
            MetricType::GAUGE => "gauge",
            MetricType::HISTOGRAM => "histogram",
            MetricType::SUMMARY => "summary",
            MetricType::UNTYPED => continue,
        };
        out.push_str("# HELP ");
        out.push_str(name);
        out.push(' ');
        escape_help(mf.help(), &mut out);
        out.push('\n');
        let _ = writeln!(out, "# TYPE {name} {kind}");
        let mut series: Vec<&Metric> = mf.get_metric().iter().collect();
        series.sort_by(|a, b| compare_series(a, b));
        for m in series {
            let labels = sorted_labels(m);
            match mf.get_field_type() {
                MetricType::COUNTER => {
                    let v = go_float(m.get_counter().get_value());
                    sample(&mut out, name, "", &labels, None, &v);
                }
                MetricType::GAUGE => {
                    let v = go_float(m.get_gauge().get_value());
                    sample(&mut out, name, "", &labels, None, &v);
                }
                // nftproxy registers no untyped metric (the crate deprecates them).
                MetricType::UNTYPED => {}
                MetricType::HISTOGRAM => {
                    let h = m.get_histogram();
                    let mut inf_seen = false;
                    for b in h.get_bucket() {
                        let ub = b.upper_bound();
                        inf_seen |= ub == f64::INFINITY;
                        let le = go_float(ub);
                        let count = b.cumulative_count().to_string();
                        sample(
                            &mut out,
                            name,
                            "_bucket",
                            &labels,
                            Some(("le", &le)),
                            &count,
                        );
                    }
                    let count = h.get_sample_count().to_string();
                    if !inf_seen {
                        sample(
                            &mut out,
                            name,
                            "_bucket",
                            &labels,
                            Some(("le", "+Inf")),
                            &count,
                        );
                    }
                    let sum = go_float(h.get_sample_sum());
                    sample(&mut out, name, "_sum", &labels, None, &sum);
                    sample(&mut out, name, "_count", &labels, None, &count);
                }
                MetricType::SUMMARY => {
                    let s = m.get_summary();
                    for q in s.get_quantile() {
                        let quantile = go_float(q.quantile());
                        let v = go_float(q.value());
                        sample(
                            &mut out,
                            name,
                            "",
                            &labels,
                            Some(("quantile", &quantile)),
                            &v,
                        );
                    }
                    let sum = go_float(s.sample_sum());
                    sample(&mut out, name, "_sum", &labels, None, &sum);
                    let count = s.sample_count().to_string();
                    sample(&mut out, name, "_count", &labels, None, &count);
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::go_float;

    #[test]
    fn floats_format_like_go() {
        // Expected values are what Go's strconv.FormatFloat(v, 'g', -1, 64) prints.
        for (v, want) in [
            (0.0, "0"),
            (1.0, "1"),
            (-1.0, "-1"),
            (0.001, "0.001"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (16.384, "16.384"),
            (0.25, "0.25"),
            (300.0, "300"),
            (100000.0, "100000"),
            (1e6, "1e+06"),
            (123456789.0, "1.23456789e+08"),
            (1733400000.5, "1.7334000005e+09"),
            (1.5e-7, "1.5e-07"),
            (f64::INFINITY, "+Inf"),
            (f64::NEG_INFINITY, "-Inf"),
            (f64::NAN, "NaN"),
            (2.5e21, "2.5e+21"),
            (0.1 + 0.2, "0.30000000000000004"),
        ] {
            assert_eq!(go_float(v), want, "{v:?}");
        }
    }
}
