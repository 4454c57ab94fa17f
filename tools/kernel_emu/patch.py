import re,sys
def balanced(s,i,open_,close):
    # s[i]==open_; return index after matching close
    d=0
    for j in range(i,len(s)):
        if s[j]==open_: d+=1
        elif s[j]==close:
            d-=1
            if d==0: return j+1
    raise Exception("unbalanced")
def fix_launch(s):
    out=[];pos=0;n=0
    for m in re.finditer(r'([A-Za-z_][A-Za-z0-9_]*(?:<[A-Za-z0-9_]+>)?)<<<',s):
        if m.start()<pos: continue
        k=m.group(1); a=m.end(); b=s.index('>>>',a); cfg=s[a:b]
        assert s[b+3]=='('; e=balanced(s,b+3,'(',')'); args=s[b+4:e-1]
        out.append(s[pos:m.start()]); out.append(f"emu::launch({k}, {cfg}, {args})"); pos=e; n+=1
    out.append(s[pos:]); return ''.join(out),n
for f in sys.argv[1:]:
    s=open(f).read(); s0=s
    # split.h keeps its device helpers for nvcc; the emulator compiles them as host code
    s=s.replace('#if defined(__CUDACC__)  // the per-value splits','#if 1  // (kernel_emu) the per-value splits')
    # row_team.h's warp and CTA teams (the row backward's) are device code the emulator runs
    if f.endswith('row_team.h'): s=s.replace('#if defined(__CUDACC__)','#if 1  // (kernel_emu) device teams')
    s,n=fix_launch(s)
    s,m1=re.subn(r'extern __shared__ __align__\(16\) unsigned char smem_raw\[\];','unsigned char* smem_raw = emu::dyn_smem;',s)
    s,m2=re.subn(r'asm volatile\(\s*"mma\.sync[^;]*;\\n"\s*:[^:]*:[^;]*\);','emu::mma(c, a, b0, b1);',s)
    # ldmatrix .x2 .trans: the shared address and the asm become emu::ldsm_x2_trans(b0, b1, row)
    s,m3=re.subn(r'const uint32_t at = static_cast<uint32_t>\(__cvta_generic_to_shared\(row\)\);\s*'
                 r'asm volatile\(\s*"ldmatrix\.sync\.aligned\.m8n8\.x2\.trans[^;]*;\\n"[^;]*\);',
                 'emu::ldsm_x2_trans(b0, b1, row);',s)
    # ldmatrix .x4: emu::ldsm_x4(r, row)
    s,m7=re.subn(r'const uint32_t at = static_cast<uint32_t>\(__cvta_generic_to_shared\(row\)\);\s*'
                 r'asm volatile\(\s*"ldmatrix\.sync\.aligned\.m8n8\.x4\.shared\.b16[^;]*;\\n"[^;]*\);',
                 'emu::ldsm_x4(r, row);',s)
    m3+=m7
    # cp.async: emu::cp_async16 queues the copy, emu::cp_async_wait_all does the thread's copies
    s,m4=re.subn(r'const uint32_t at = static_cast<uint32_t>\(__cvta_generic_to_shared\(dst\)\);\s*'
                 r'asm volatile\(\s*"cp\.async\.cg\.shared\.global[^;]*;\\n"[^;]*\);',
                 'emu::cp_async16(dst, src, valid);',s)
    s,m5=re.subn(r'asm volatile\(\s*"cp\.async\.wait_all;\\n"[^;]*\);','emu::cp_async_wait_all();',s)
    # the SFU's 2^x with results below 2^-126 flushed to 0
    s,m6=re.subn(r'asm\("ex2\.approx\.ftz\.f32 %0, %1;" : "=f"\(y\) : "f"\(x\)\);','y = emu::ex2_ftz(x);',s)
    print(f,'launches',n,'smem',m1,'mma',m2,'ldsm',m3,'cp.async',m4,'wait',m5,'ex2',m6)
    open(f,'w').write(s)
