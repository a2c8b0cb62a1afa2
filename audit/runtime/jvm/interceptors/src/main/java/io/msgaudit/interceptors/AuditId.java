package io.msgaudit.interceptors;

import java.nio.ByteBuffer;
import java.nio.charset.CharacterCodingException;
import java.nio.charset.CodingErrorAction;
import java.nio.charset.StandardCharsets;
import java.util.Arrays;

import org.apache.kafka.common.header.Header;
import org.apache.kafka.common.header.Headers;

/**
 * A record's message identity (audit.pid, audit.seq) when its audit headers are valid by the parse
 * rules of docs/design.md §3.2 (audit/core/headers.py), else null: a consumption row then carries
 * no pid/seq and is matched to the record by (partition, offset), as capture keys an unaudited
 * record.
 */
final class AuditId {
    static final long MAX_TS_MS = 253_402_300_799_999L;

    static final class Id {
        final String pid;
        final long seq;
        final long tsMs; // audit.ts: the message's produce time, epoch ms

        Id(String pid, long seq, long tsMs) {
            this.pid = pid;
            this.seq = seq;
            this.tsMs = tsMs;
        }
    }

    private AuditId() {}

    static Id parse(Headers headers) {
        if (headers == null) {
            return null;
        }
        byte[] pid = null;
        byte[] seq = null;
        byte[] ts = null;
        byte[] key = null;
        byte[] packed = null;
        int nId = 0;
        int nPid = 0;
        int nSeq = 0;
        int nTs = 0;
        int nKey = 0;
        for (Header h : headers) {
            switch (h.key()) {
                case AuditProducerInterceptor.PID: pid = h.value(); nPid++; break;
                case AuditProducerInterceptor.SEQ: seq = h.value(); nSeq++; break;
                case AuditProducerInterceptor.TS: ts = h.value(); nTs++; break;
                case "audit.key": key = h.value(); nKey++; break;
                case AuditProducerInterceptor.ID: packed = h.value(); nId++; break;
                default: break;
            }
        }
        if (nKey > 1 || (nKey == 1 && (key == null || key.length == 0))) {
            return null;
        }
        if (nId > 0) { // the packed form, alone: <pid>/<seq>/<ts>, split at its last two '/'
            if (nId > 1 || nPid + nSeq + nTs > 0 || packed == null) {
                return null;
            }
            int b = lastSlash(packed, packed.length);
            int a = b < 0 ? -1 : lastSlash(packed, b);
            if (a < 0) {
                return null;
            }
            pid = Arrays.copyOfRange(packed, 0, a);
            seq = Arrays.copyOfRange(packed, a + 1, b);
            ts = Arrays.copyOfRange(packed, b + 1, packed.length);
            if (utf8(packed) == null) {
                return null;
            }
        } else if (nPid != 1 || nSeq != 1 || nTs != 1 || pid == null || seq == null || ts == null) {
            return null;
        }
        String p = utf8(pid);
        if (p == null || p.isEmpty() || p.codePointCount(0, p.length()) > AuditProducerInterceptor.MAX_PID_CHARS
                || (key != null && utf8(key) == null)) {
            return null;
        }
        long s = digits(seq, Long.MAX_VALUE);
        long t = digits(ts, MAX_TS_MS);
        if (s < 0 || t < 0) {
            return null;
        }
        return new Id(p, s, t);
    }

    private static int lastSlash(byte[] b, int end) {
        for (int i = end - 1; i >= 0; i--) {
            if (b[i] == '/') {
                return i;
            }
        }
        return -1;
    }

    private static String utf8(byte[] b) {
        try {
            return StandardCharsets.UTF_8.newDecoder().onMalformedInput(CodingErrorAction.REPORT)
                    .onUnmappableCharacter(CodingErrorAction.REPORT).decode(ByteBuffer.wrap(b)).toString();
        } catch (CharacterCodingException e) {
            return null;
        }
    }

    /** ASCII digits only, at most {@code max}; -1 otherwise. */
    static long digits(byte[] b, long max) {
        if (b.length == 0) {
            return -1;
        }
        long v = 0;
        for (byte c : b) {
            if (c < '0' || c > '9') {
                return -1;
            }
            int d = c - '0';
            if (v > (max - d) / 10) {
                return -1;
            }
            v = v * 10 + d;
        }
        return v;
    }
}
