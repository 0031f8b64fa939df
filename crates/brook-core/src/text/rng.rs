//! The sampler's random numbers: xoshiro256** seeded through splitmix64 (Blackman and
//! Vigna's reference constants), written out here rather than taken from `rand`, so a seed
//! means the same stream of tokens across brook versions whatever a dependency changes.

/// xoshiro256** 1.0 (Blackman & Vigna, 2018).
#[derive(Debug, Clone)]
pub(super) struct Xoshiro256 {
    s: [u64; 4],
}

impl Xoshiro256 {
    pub(super) fn seed_from_u64(seed: u64) -> Self {
        let mut x = seed;
        let mut next = || {
            // splitmix64
            x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        };
        Self {
            s: [next(), next(), next(), next()],
        }
    }

    pub(super) fn next_u64(&mut self) -> u64 {
        let s = &mut self.s;
        let result = s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        result
    }

    /// Uniform in [0, 1) with 53 random bits.
    pub(super) fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::Xoshiro256;

    #[test]
    fn splitmix_seeding_matches_reference_vector() {
        // splitmix64 from seed 0 starts 0xe220a8397b1dcdaf (Vigna's splitmix64.c).
        let r = Xoshiro256::seed_from_u64(0);
        assert_eq!(r.s[0], 0xe220_a839_7b1d_cdaf);
    }
}
