//! The benchmarks' statistics: the one `median` and its confidence interval.

pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Median of `v` with a distribution-free 95 % confidence interval (order statistics of the
/// binomial sign test): (median, low, high). With fewer than 6 values the interval is the range.
pub fn median_ci(v: &[f64]) -> (f64, f64, f64) {
    assert!(!v.is_empty());
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let n = s.len();
    let m = s[n / 2];
    // Largest k with P(Binomial(n, 1/2) < k) <= 2.5 %: the interval is [s[k-1], s[n-k]].
    let mut k = 0usize;
    let mut cdf = 0.0f64;
    let mut c = 1.0f64; // C(n, i)
    let p = 0.5f64.powi(n as i32);
    for i in 0..n {
        if cdf + c * p > 0.025 {
            break;
        }
        cdf += c * p;
        k = i + 1;
        c = c * (n - i) as f64 / (i + 1) as f64;
    }
    if k == 0 {
        (m, s[0], s[n - 1])
    } else {
        (m, s[k - 1], s[n - k])
    }
}

/// The `q` quantile (nearest rank) of a non-empty sample.
pub fn quantile(mut v: Vec<f64>, q: f64) -> f64 {
    assert!(!v.is_empty() && (0.0..=1.0).contains(&q));
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * q).round() as usize]
}
