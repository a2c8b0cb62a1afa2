package io.msgaudit.interceptors;

/** Decimal digits of non-negative longs written straight into byte arrays, two at a time, and read back. */
final class Digits {
    private static final byte[] TENS = new byte[100];
    private static final byte[] ONES = new byte[100];

    static {
        for (int i = 0; i < 100; i++) {
            TENS[i] = (byte) ('0' + i / 10);
            ONES[i] = (byte) ('0' + i % 10);
        }
    }

    private Digits() {}

    /** How many decimal digits v >= 0 has. */
    static int length(long v) {
        int n = 1;
        long bound = 10;
        while (n < 19 && v >= bound) {
            bound *= 10;
            n++;
        }
        return n;
    }

    /** Write the digits of v >= 0 so that they end just before {@code end}. */
    static void put(byte[] out, int end, long v) {
        int p = end;
        while (v >= 100) {
            long q = v / 100;
            int r = (int) (v - q * 100);
            out[--p] = ONES[r];
            out[--p] = TENS[r];
            v = q;
        }
        int r = (int) v;
        if (r >= 10) {
            out[--p] = ONES[r];
            out[--p] = TENS[r];
        } else {
            out[--p] = (byte) ('0' + r);
        }
    }

    /** The number written in {@code v[from..to)} as plain decimal digits (1 to 18 of them), else -1. */
    static long parse(byte[] v, int from, int to) {
        if (to <= from || to - from > 18) {
            return -1;
        }
        long x = 0;
        for (int i = from; i < to; i++) {
            int d = v[i] - '0';
            if (d < 0 || d > 9) {
                return -1;
            }
            x = x * 10 + d;
        }
        return x;
    }
}
