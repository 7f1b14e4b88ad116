//! The transfer checksum: XXH3-64 over a page's transferred bytes, in transfer order.
//!
//! Both sides compute it over the same byte sequence: for each layer, the K chunk(s) then the
//! V chunk(s) of the page's filled slots, exactly as the work requests gather them. A CUDA node
//! must produce the same value (the algorithm is fixed: XXH3-64, seed 0, streaming over chunks is
//! identical to hashing their concatenation).

use xxhash_rust::xxh3::Xxh3;

/// The streaming form of [`page_checksum`].
pub use xxhash_rust::xxh3::Xxh3 as Checksummer;

/// Checksum of the concatenation of `chunks`.
pub fn page_checksum<'a>(chunks: impl IntoIterator<Item = &'a [u8]>) -> u64 {
    let mut h = Xxh3::new();
    for c in chunks {
        h.update(c);
    }
    h.digest()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streaming_equals_concatenation_and_detects_a_flip() {
        let data: Vec<u8> = (0..10_000u32).map(|i| (i * 31 % 251) as u8).collect();
        let whole = page_checksum([&data[..]]);
        let parts = page_checksum([&data[..17], &data[17..4096], &data[4096..]]);
        assert_eq!(whole, parts);
        assert_eq!(whole, xxhash_rust::xxh3::xxh3_64(&data));
        let mut bad = data.clone();
        bad[5000] ^= 1;
        assert_ne!(page_checksum([&bad[..]]), whole);
    }
}
