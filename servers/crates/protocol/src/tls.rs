//! What both ends of a TLS connection agree on beyond the ALPN names (`crate::direct`): the
//! crypto provider, so the server and the client core prefer the same cipher suites.

/// ring's provider with AES-128-GCM preferred: as strong as TLS needs, and about a third faster
/// than AES-256-GCM per byte, which is what a block transfer spends its TLS time on.
pub fn crypto_provider() -> rustls::crypto::CryptoProvider {
    let mut provider = rustls::crypto::ring::default_provider();
    provider
        .cipher_suites
        .sort_by_key(|suite| match suite.suite() {
            rustls::CipherSuite::TLS13_AES_128_GCM_SHA256 => 0,
            rustls::CipherSuite::TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256
            | rustls::CipherSuite::TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256 => 1,
            _ => 2,
        });
    provider
}

#[cfg(test)]
mod tests {
    #[test]
    fn aes_128_gcm_comes_first() {
        let provider = super::crypto_provider();
        assert_eq!(
            provider.cipher_suites[0].suite(),
            rustls::CipherSuite::TLS13_AES_128_GCM_SHA256
        );
        assert_eq!(
            provider.cipher_suites.len(),
            rustls::crypto::ring::default_provider().cipher_suites.len()
        );
    }
}
