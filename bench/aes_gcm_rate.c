/* The machine's AES-256-GCM rate, the peer of bench.encrypted_throughput and the limit of
 * bench.encrypted_cpu: a loop sealing `count` messages of `size` bytes, each with a 32-byte
 * clear header as associated data and a 16-byte tag, a new nonce each (as network_crypto.c
 * seals a datagram), through OpenSSL's EVP; then a loop opening one such sealed message
 * `count` times (nonce set, header, ciphertext, tag checked), as network_crypto.c opens a
 * datagram.  Prints "<seals per second> <MB per second sealed> <opens per second>", per second
 * of the loop's own CPU time (CLOCK_THREAD_CPUTIME_ID): what the cipher does on a core it holds,
 * however loaded the machine.
 *
 *     aes_gcm_rate SIZE COUNT */
#include <openssl/evp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: aes_gcm_rate SIZE COUNT\n");
        return 2;
    }
    const int size = atoi(argv[1]);
    const long count = atol(argv[2]);
    if (size <= 0 || count <= 0) return 2;
    uint8_t key[32], iv[12] = {0}, header[32] = {0}, tag[16];
    for (int i = 0; i < 32; i++) key[i] = (uint8_t)i;
    uint8_t *plain = calloc(1, (size_t)size), *sealed = malloc((size_t)size + 16);
    EVP_CIPHER_CTX *ctx = EVP_CIPHER_CTX_new();
    if (plain == NULL || sealed == NULL || ctx == NULL ||
        EVP_EncryptInit_ex(ctx, EVP_aes_256_gcm(), NULL, key, NULL) <= 0)
        return 1;
    struct timespec start, end;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &start);
    for (long n = 0; n < count; n++) {
        int length;
        memcpy(iv + 4, &n, sizeof n);
        if (EVP_EncryptInit_ex(ctx, NULL, NULL, NULL, iv) <= 0 ||
            EVP_EncryptUpdate(ctx, NULL, &length, header, sizeof header) <= 0 ||
            EVP_EncryptUpdate(ctx, sealed, &length, plain, size) <= 0 ||
            EVP_EncryptFinal_ex(ctx, sealed + length, &length) <= 0 ||
            EVP_CIPHER_CTX_ctrl(ctx, EVP_CTRL_AEAD_GET_TAG, 16, tag) <= 0)
            return 1;
    }
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &end);
    const double seconds = (double)(end.tv_sec - start.tv_sec) +
                           (double)(end.tv_nsec - start.tv_nsec) / 1e9;
    /* The last message sealed, opened again and again under its own nonce. */
    EVP_CIPHER_CTX *opener = EVP_CIPHER_CTX_new();
    uint8_t *opened = malloc((size_t)size);
    if (opener == NULL || opened == NULL ||
        EVP_DecryptInit_ex(opener, EVP_aes_256_gcm(), NULL, key, NULL) <= 0)
        return 1;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &start);
    for (long n = 0; n < count; n++) {
        int length;
        if (EVP_DecryptInit_ex(opener, NULL, NULL, NULL, iv) <= 0 ||
            EVP_DecryptUpdate(opener, NULL, &length, header, sizeof header) <= 0 ||
            EVP_DecryptUpdate(opener, opened, &length, sealed, size) <= 0 ||
            EVP_CIPHER_CTX_ctrl(opener, EVP_CTRL_AEAD_SET_TAG, 16, tag) <= 0 ||
            EVP_DecryptFinal_ex(opener, opened + length, &length) <= 0)
            return 1; /* the tag did not verify: a bug here, not a measure */
    }
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &end);
    const double open_seconds = (double)(end.tv_sec - start.tv_sec) +
                                (double)(end.tv_nsec - start.tv_nsec) / 1e9;
    printf("%.1f %.1f %.1f\n", (double)count / seconds, (double)count * size / seconds / 1e6,
           (double)count / open_seconds);
    EVP_CIPHER_CTX_free(ctx);
    EVP_CIPHER_CTX_free(opener);
    free(plain);
    free(sealed);
    free(opened);
    return 0;
}
